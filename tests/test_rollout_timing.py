"""A rollout's tokens_per_s counts generation only: the engine's set-up (building the static engine, compiling,
capturing graphs) is reported as its own timing, not charged to the throughput."""

import time

import pytest
import torch
from tinybp import tiny_blueprint

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("engine", ["static", "hf"])
def test_tokens_per_s_excludes_the_engine_set_up(tiny_kit, tmp_path, engine):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verlflow.core.ml.data import load_prompts
    from verlflow.core.ml.placement import Placement
    from verlflow.core.ml.rollout import generate_share, save_batch

    bp = tiny_blueprint(tiny_kit, tmp_path, rollout__engine=engine, rollout__micro_batch_size=2)
    tok = AutoTokenizer.from_pretrained(tiny_kit["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(tiny_kit["model_dir"]).eval()
    data = load_prompts(bp.data.train_files, bp.data.prompt_key)
    rows = list(range(bp.data.batch_size))
    t0 = time.perf_counter()
    samples = generate_share(model, tok, bp.rollout, bp.reward, data.take(rows), 1,
                             Placement(0, 1, torch.device("cpu")), max_prompt_len=bp.data.max_prompt_length,
                             seed=bp.seed)
    wall = time.perf_counter() - t0
    stats = save_batch(samples, tmp_path, tok.pad_token_id, bp.rollout.max_new_tokens)
    if engine == "static":
        assert stats["engine_setup_s"] > 0  # the engine was built for this model: its set-up is counted apart
    else:
        assert stats["engine_setup_s"] == 0  # HF generate has no set-up of its own
    assert stats["sampling_s"] + stats["engine_setup_s"] <= wall  # disjoint parts of the call
    assert stats["tokens_per_s"] == pytest.approx(stats["tokens"] / stats["sampling_s"], rel=0.01)

"""What a run keeps in its store at its peak, estimated before it runs (the space preflight: core/orchestrate/
preflight.py `check_space`).

The parameter count is exact, from the model folder's safetensors headers (no weights read, no torch import: the
CLI runs this before anything touches the store). Each term follows what a stage really writes:

- training checkpoints: the build's initial policy (core/stages/build.py; its optimizer never stepped, so no
  AdamW state) and every update's (core/stages/update.py), each the policy with its AdamW state (+ the critic
  with its own for adv_estimator gae), DCP in model.dtype (the master weights; AdamW's moments take their
  parameter's dtype). Retention (issue 15 item 1, core/store/retention.py) treats the build's as iteration 0
  and keeps the last storage.keep_last_checkpoints, the best by storage.keep_best_metric and the one `latest`
  names (older than those when exports are further apart); the newest is written before an older one is pruned,
  so one more at the peak.
- the reference: the build's ref/ (model only, model.dtype) and hf_meta/, never pruned (every update reads them).
- model.lora: a training checkpoint holds the adapters and their AdamW state only (the base is the reference's);
  storage.export_lora=adapter exports the adapters alone.
- HF exports (core/stages/export.py): save_pretrained in storage.export_dtype (auto: the model folder's
  config dtype) plus the folder's other files (config, tokenizer). Kept: storage.keep_last, the best, and the
  one being written (counted apart from the checkpoint being written: with warm workers an update's background
  commit overlaps the export).
- phases (blueprint `phases:`): each sft/dpo phase keeps its last storage.keep_last_checkpoints epochs, plus the
  one being written; each phase's start policy stays for a rerun of that phase (the model's build: counted here
  beside the rl phase's last N); an rl phase that starts from another phase's policy has its own build (its
  reference and initial policy, the policy kept while it ranks best).
- rollout batches (core/ml/rollout.py save_batch): never pruned, so one per iteration.
- evaluations (core/ml/evaluate.py): samples.parquet and the metrics, never pruned, one per evaluated policy.

DCP writes each tensor shard through torch.save and each flattened optimizer field as a pickled entry, both
listed in its .metadata: a fixed cost per item that is a third of the test kit's checkpoint and nothing at 1.5B.
"""

import json
from dataclasses import dataclass
from pathlib import Path

from verlflow.core.blueprint import Blueprint

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
DCP_ITEM = 2048  # bytes per DCP item: torch.save's zip records (~1.6 kB) + its .metadata entry (~0.3 kB)
ADAMW_FIELDS = 12  # AdamW's param-group fields (lr, betas, eps, ...) plus `step`, saved per parameter (flattened)
STAGE_FILES = 8192  # a stage's manifest, state.json and index entry
SAFETENSORS_ENTRY = 160  # a tensor's entry in a safetensors header (name, dtype, shape, offsets as JSON)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")


@dataclass(frozen=True)
class Term:
    name: str
    count: int  # how many the store holds at once at the peak
    each: int  # bytes each
    detail: str = ""  # what one holds

    @property
    def bytes(self) -> int:
        return self.count * self.each


@dataclass(frozen=True)
class Footprint:
    terms: tuple[Term, ...]

    @property
    def total(self) -> int:
        return sum(t.bytes for t in self.terms)

    def term(self, name: str) -> Term:
        return next(t for t in self.terms if t.name == name)

    def describe(self) -> str:
        parts = [f"{t.name}{f' ({t.detail})' if t.detail else ''} "
                 + (f"{t.count} x {human(t.each)}" if t.count != 1 else human(t.each)) for t in self.terms if t.count]
        return f"~{human(self.total)} at its peak ({', '.join(parts)})"


def human(n: int) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} B"


@dataclass(frozen=True)
class ModelSize:
    """The parameters as the safetensors headers list them, and what else an export copies."""
    numel: int
    tensors: int
    head_numel: int  # the output layer (vocab x hidden)
    tied: bool  # the headers hold no lm_head: the model shares the input embedding
    hidden: int
    meta_bytes: int  # the folder's other files (config, tokenizer): hf_meta/ and every export copy them
    linears: tuple = ()  # (module name, out, in) of every 2-D weight but the input embedding

    @classmethod
    def of(cls, model_dir: Path) -> "ModelSize":
        from safetensors import safe_open

        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
        numel = tensors = 0
        names: set[str] = set()
        linears = []
        for f in sorted(model_dir.glob("*.safetensors")):
            with safe_open(str(f), framework="numpy") as st:  # the header only
                for name in st.keys():
                    shape = st.get_slice(name).get_shape()
                    numel += _prod(shape)
                    tensors += 1
                    names.add(name)
                    if len(shape) == 2 and name.endswith(".weight") and "embed" not in name:
                        linears.append((name[: -len(".weight")], shape[0], shape[1]))
        if not tensors:  # pickled *.bin weights only: their size over the config's dtype, no header to read
            itemsize = ITEMSIZE.get(str(config.get("dtype") or config.get("torch_dtype")), 4)
            numel = sum(f.stat().st_size for f in model_dir.glob("*.bin")) // itemsize
            names.add("lm_head.weight")  # unknown: count no shared head
        hidden = _config_int(config, "hidden_size")
        if linears and "lm_head.weight" not in names:  # a tied head is a Linear module all the same
            linears.append(("lm_head", _config_int(config, "vocab_size"), hidden))
        meta = sum(p.stat().st_size for p in model_dir.iterdir()
                   if p.is_file() and not p.name.endswith(WEIGHT_SUFFIXES))
        return cls(numel, tensors, _config_int(config, "vocab_size") * hidden, "lm_head.weight" not in names, hidden,
                   meta, tuple(linears))

    def adapters(self, spec) -> "ModelSize":
        """model.lora's adapters: per targeted linear layer A (rank x in) and B (out x rank), matched as PEFT
        matches target_modules (the module's name or its last parts)."""
        hit = [(o, i) for name, o, i in self.linears if any(_targets(name, t) for t in spec.target_modules)]
        return ModelSize(sum(spec.rank * (o + i) for o, i in hit), 2 * len(hit), 0, False, self.hidden, 0)

    def unmatched_targets(self, spec) -> list[str]:
        """model.lora.target_modules entries that name no linear layer of this model."""
        return [t for t in spec.target_modules if not any(_targets(name, t) for name, _, _ in self.linears)]

    def linear_names(self) -> list[str]:
        return sorted({name.rsplit(".", 1)[-1] for name, _, _ in self.linears})


    def dcp_bytes(self, itemsize: int, world: int, *, optimizer: bool) -> int:
        """A DCP checkpoint of the causal LM at `world` ranks. Its model state lists a tied head under both names
        (written twice); the optimizer holds the shared parameter once."""
        state_numel = self.numel + (self.head_numel if self.tied else 0)
        state_tensors = self.tensors + self.tied
        total = state_numel * itemsize + state_tensors * world * DCP_ITEM
        if optimizer:  # exp_avg and exp_avg_sq sharded like the parameters; the fields once per parameter
            total += 2 * self.numel * itemsize + self.tensors * (2 * world + ADAMW_FIELDS) * DCP_ITEM
        return total

    def critic(self) -> "ModelSize":
        """The critic (AutoModelForTokenClassification, num_labels 1): the backbone and a hidden x 1 score layer
        (weight and bias) in place of the output layer."""
        head = 0 if self.tied else self.head_numel
        return ModelSize(self.numel - head + self.hidden + 1, self.tensors - (not self.tied) + 2, 0, False,
                         self.hidden, self.meta_bytes)

    def export_bytes(self, itemsize: int) -> int:
        """save_pretrained's safetensors (a tied head once) plus the copied meta files."""
        return self.numel * itemsize + self.tensors * SAFETENSORS_ENTRY + self.meta_bytes


def _targets(module: str, target: str) -> bool:
    """PEFT's match of a target_modules entry: the module's whole name or its last parts."""
    if target == "all-linear":  # PEFT leaves the output layer out
        return module != "lm_head"
    return module == target or module.endswith("." + target)


def _config_int(config: dict, key: str) -> int:
    """A size from config.json (a multimodal model's text part nests it); 0 where absent (no head to count)."""
    text = config.get("text_config")
    value = config.get(key, text.get(key) if isinstance(text, dict) else 0)
    return value if isinstance(value, int) else 0


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def export_itemsize(bp: Blueprint, model_dir: Path) -> int:
    dtype = bp.storage.export_dtype
    if dtype == "auto":
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
        dtype = config.get("dtype") or config.get("torch_dtype") or bp.model.dtype
    return ITEMSIZE.get(str(dtype), 4)


def exports_at_once(bp: Blueprint) -> int:
    s, n = bp.storage, bp.iterations
    exports = n // s.export_every + (n % s.export_every != 0)  # every export_every iterations, and the last
    return min(exports, s.keep_last + bool(s.keep_best_metric) + 1)


def checkpoints_at_once(bp: Blueprint) -> int:
    """Training checkpoints at once, the build's initial one (iteration 0) among them."""
    s = bp.storage
    # `latest` names the last export's update: older than the last keep_last_checkpoints when exports are sparser
    # (with one export only, at the last iteration, this run's `latest` names nothing before it)
    pointed = s.keep_last_checkpoints < s.export_every < bp.iterations
    return min(bp.iterations + 1, s.keep_last_checkpoints + bool(s.keep_best_metric) + pointed + 1)


def phase_checkpoints(bp: Blueprint) -> tuple[int, int]:
    """(training checkpoints, references) a run of phases keeps beyond the rl phase's own (checkpoints_at_once)."""
    if not bp.phases:
        return 0, 0
    k = bp.storage.keep_last_checkpoints
    epochs = [min(ph.epochs, k) for ph in bp.phases if ph.kind in ("sft", "dpo")]
    rl = [i for i, ph in enumerate(bp.phases) if ph.kind == "rl"]
    own_build = bool(rl) and (rl[0] > 0 and bp.phases[rl[0]].init_from != "model")
    # + the epoch being written, + the model's build held as a phase's start (an rl phase's own build is the
    # iteration 0 of checkpoints_at_once)
    return sum(epochs) + bool(epochs) + 1, int(own_build)


def batch_bytes(bp: Blueprint) -> int:
    """batch.safetensors (int64 prompts and responses with their masks, padded to the limits; fp32 scores, int64
    groups) and samples.parquet (the response text, at most ~4 bytes a token before compression)."""
    samples, prompt, response = bp.data.batch_size * bp.rollout.n, bp.data.max_prompt_length, response_tokens(bp)
    tensors = samples * ((2 * prompt + 2 * response) * 8 + 12)
    if bp.rollout.agent is not None:  # loss_mask and token_rewards beside the responses
        tensors += samples * response * 12
    if bp.algorithm.old_logprobs == "rollout":  # the rollout's fp32 log-probs of each response token
        tensors += samples * response * 4
    parquet = 4096 + samples * (response * 4 + 64)
    return tensors + 8 * SAFETENSORS_ENTRY + parquet


def response_tokens(bp: Blueprint) -> int:
    """A response's tokens at most: rollout.max_new_tokens, or in agent mode every turn and observation after the
    prompt (rollout.agent.max_total_tokens bounds them)."""
    agent = bp.rollout.agent
    return agent.max_total_tokens if agent is not None else bp.rollout.max_new_tokens


def eval_bytes(bp: Blueprint) -> int:
    """One evaluation (core/ml/evaluate.py): samples.parquet (each sample's response text, at most ~4 bytes a
    token, and its columns) and the manifest's metrics with the shown samples. Unreadable files count no rows
    (the preflight names them)."""
    ev = bp.eval
    prompts = sum(min(_parquet_rows(f), ev.max_prompts or 2**62) for f in ev.files)
    response = response_tokens(bp) if bp.rollout.agent is not None else ev.max_new_tokens or bp.rollout.max_new_tokens
    return 4096 + prompts * ev.n * (response * 4 + 96) + 2048 * (1 + ev.samples_shown)


def _parquet_rows(path: str) -> int:
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path).metadata.num_rows  # the footer only
    except Exception:  # noqa: BLE001 - missing or not parquet: the preflight says so
        return 0


def evaluations(bp: Blueprint) -> int:
    return sum(bp.evaluates_at(i) for i in range(bp.iterations + 1))


def estimate(bp: Blueprint, size: ModelSize | None = None) -> Footprint:
    """The bytes a run of `bp` holds in its store at its peak, by term (`size`: the model folder's, if read)."""
    model_dir = Path(bp.model.path)
    size = size or ModelSize.of(model_dir)
    itemsize, world = ITEMSIZE[bp.model.dtype], bp.resources.world_size
    adapters = size.adapters(bp.model.lora) if bp.model.lora is not None else None
    policy = (adapters or size).dcp_bytes(itemsize, world, optimizer=True)
    critic = size.critic().dcp_bytes(itemsize, world, optimizer=True) if bp.algorithm.adv_estimator == "gae" else 0
    reference = size.dcp_bytes(itemsize, world, optimizer=False)
    trained = f"{'LoRA adapters' if adapters else 'policy'}{' + critic' if critic else ''} + AdamW, {bp.model.dtype}"
    # The build's initial checkpoint holds no AdamW state (its optimizer never stepped): at the peak only when the
    # run is short enough that retention keeps every checkpoint (else the peak is held by updates alone).
    initial = (adapters or size).dcp_bytes(itemsize, world, optimizer=False) + (
        size.critic().dcp_bytes(itemsize, world, optimizer=False) if critic else 0)
    checkpoints = checkpoints_at_once(bp)
    build_held = int(checkpoints == bp.iterations + 1)  # 1 when the initial one is among those held
    exported = export_itemsize(bp, model_dir)
    adapter_export = adapters is not None and bp.storage.export_lora == "adapter"
    export = adapters.export_bytes(exported) + size.meta_bytes if adapter_export else size.export_bytes(exported)
    phase_ckpts, phase_refs = phase_checkpoints(bp)
    return Footprint((
        Term("training checkpoints", checkpoints - build_held, policy + critic + 2 * STAGE_FILES, trained),
        Term("initial checkpoint", build_held, initial + STAGE_FILES, "the build's, no AdamW state"),
        Term("phase checkpoints", phase_ckpts, policy + 2 * STAGE_FILES, "sft/dpo epochs and phase starts"),
        Term("reference", 1 + phase_refs, reference + size.meta_bytes + STAGE_FILES,
             f"{bp.model.dtype}, with hf_meta"),
        Term("HF exports", exports_at_once(bp), export + STAGE_FILES,
             f"{'adapter folders, ' if adapter_export else ''}{exported} bytes a parameter"),
        Term("rollout batches", bp.iterations, batch_bytes(bp) + STAGE_FILES, "never pruned"),
        Term("evaluations", evaluations(bp), eval_bytes(bp) + STAGE_FILES, "never pruned"),  # 0 without eval.files
        Term("validate report", 1, 4096 * world + STAGE_FILES),
    ))

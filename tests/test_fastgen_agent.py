"""The static engine serving multi-turn agent rollouts (issue 40): continuous batching over a TurnSource. Each turn's
whole context is prefilled into a free row; a trajectory whose tool is running holds no row, so the others keep
decoding; every turn's tokens and log-probs are what the engine gives that context alone. CPU, fp32, the tiny kit."""

import threading
from collections import deque
from dataclasses import dataclass

import pytest
import torch

from verlflow.core.ml.fastgen import EngineOptions, FastGen, SamplingConfig

pytestmark = [pytest.mark.stages, pytest.mark.usefixtures("one_torch_thread")]

EOS, PAD = 3, 0  # verlflow.core.testing.tinykit's special-token ids
GREEDY = SamplingConfig(temperature=0.0)
PATIENCE_S = 30  # a wait this long means a deadlock (the tests' turns come within milliseconds): fail, never hang


@pytest.fixture(scope="module")
def model(tiny_kit):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(tiny_kit["model_dir"]).eval()
    with torch.no_grad():
        m.lm_head.weight[EOS] *= 4.0  # says EOS often: turns end at very different lengths
    return m


@dataclass
class Turn:  # core/agent/loop.py's Turn, structurally
    key: int
    context: list[int]
    budget: int


class ToolSource:
    """A TurnSource over trajectories of ``turns`` model turns each. After a turn (but the last) the trajectory's
    "tool" runs on a thread of its own: ``tool(key, n)`` (which may block) and then the next turn is queued, its
    context the last one's plus the sampled tokens plus a few observation ids. ``events`` records in order what
    happened: ("start", key) when the engine takes a turn, ("done", key), ("tool", key), ("back", key)."""

    def __init__(self, prompts, turns: int, budgets=(6, 3, 12), tool=lambda key, n: None):
        self.cv = threading.Condition()
        self.queue = deque(Turn(k, list(p), budgets[0]) for k, p in enumerate(prompts))
        self.left = dict.fromkeys(range(len(prompts)), turns)
        self.turns, self.budgets, self.tool = turns, budgets, tool
        self.events: list = []
        self.finished: list = []  # (turn, tokens, logprobs)
        self.threads: list = []
        self.gone: set = set()  # trajectories ended() named

    def ready(self, limit: int) -> list[Turn]:
        with self.cv:
            got = [self.queue.popleft() for _ in range(min(limit, len(self.queue)))]
            self.events += [("start", t.key) for t in got]
            return got

    def done(self, turn: Turn, tokens: list[int], logprobs: list[float]):
        with self.cv:
            self.events.append(("done", turn.key))
            self.finished.append((turn, tokens, logprobs))
            self.left[turn.key] -= 1
            self.cv.notify_all()
            if not self.left[turn.key]:
                return
        n = self.turns - self.left[turn.key]
        th = threading.Thread(target=self._run_tool, args=(turn, tokens, n), daemon=True)
        self.threads.append(th)
        th.start()

    def _run_tool(self, turn: Turn, tokens: list[int], n: int):
        with self.cv:
            self.events.append(("tool", turn.key))
        self.tool(turn.key, n)
        observation = [7 + (31 * turn.key + 7 * n + i) % 300 for i in range(3)]
        with self.cv:
            self.events.append(("back", turn.key))
            self.queue.append(Turn(turn.key, turn.context + tokens + observation, self.budgets[n % len(self.budgets)]))
            self.cv.notify_all()

    def ended(self) -> list[int]:
        with self.cv:
            keys = [k for k, n in self.left.items() if not n and k not in self.gone]
            self.gone.update(keys)
            return keys

    def wait(self, timeout: float | None = None) -> bool:
        with self.cv:
            if not self.cv.wait_for(lambda: self.queue or not any(self.left.values()), timeout or PATIENCE_S):
                raise TimeoutError(f"no turn came in {PATIENCE_S} s: the engine waits for rows it holds itself?")
            return bool(self.queue)


def prompts_of(lens, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(7, 384, (n,), generator=g).tolist() for n in lens]


def alone(eng: FastGen, context: list[int], budget: int, eos=(EOS,)) -> tuple[list[int], list[float]]:
    """What a micro-batch of this one context gives (greedy): its tokens up to and with EOS, and their log-probs."""
    ids = torch.tensor([context])
    row = eng.generate(ids, torch.ones_like(ids), GREEDY, list(eos), PAD, limits=torch.tensor([budget]))[0].tolist()
    n = next((i + 1 for i, t in enumerate(row[:budget]) if t in eos), budget)
    return row[:n], eng.last_logprobs[0, :n].tolist()


@pytest.mark.parametrize("turn_cache", [False, True], ids=["prefilled", "turn_cache"])
def test_every_turn_is_what_the_engine_gives_its_context_alone(model, turn_cache):
    """7 trajectories of 3 turns through 3 rows, tools answering from threads: rows are refilled beside running ones
    with contexts that grow turn by turn (prompt, turns, observations), and every turn's tokens are the greedy
    micro-batch's for that context alone, token for token, with its log-probs. With the turn cache, later turns go
    on in the rows their trajectories left (fed the last sampled token and the observation, EOS ids among them)
    or, when another turn took that row, are prefilled: both give the same."""
    prompts = prompts_of([5, 11, 3, 16, 8, 1, 9], seed=4)
    source = ToolSource(prompts, turns=3)
    # a prefilled slot priced as a row of a decode step: resuming is the cheaper here (not so on a CPU, measured)
    eng = FastGen(model, 3, 64, 12, EngineOptions(bucket=8, check_every=2, turn_cache=turn_cache, prefill_cost=1.0))
    stats = eng.generate_turns(source, GREEDY, [EOS], PAD, refill_min=1)
    assert len(source.finished) == stats["turns"] == 21
    assert stats["tokens"] == sum(len(t) for _, t, _ in source.finished)
    if turn_cache:  # every prompt is prefilled once; most later turns resume
        assert stats["resumed"] >= 7 and stats["refills"] >= 3 and stats["forced_tokens"] >= 4 * stats["resumed"]
        assert stats["refills"] + stats["resumed"] <= 21
    else:
        assert stats["refills"] >= 8 and "resumed" not in stats
    assert max(len(turn.context) for turn, _, _ in source.finished) > 16 + 3  # later turns: longer than any prompt
    assert len({len(t) for _, t, _ in source.finished}) >= 4  # ragged: rows finished apart
    for turn, tokens, logprobs in source.finished:
        want_tokens, want_logprobs = alone(eng, turn.context, turn.budget)
        assert tokens == want_tokens, turn
        assert torch.allclose(torch.tensor(logprobs), torch.tensor(want_logprobs), atol=1e-5), turn


def test_a_trajectory_waiting_for_its_tool_holds_no_row(model):
    """Trajectory 0's first tool call returns only once three turns of the other trajectories have ended after it
    began: it can, because the engine keeps decoding (and refilling) the other rows meanwhile. An engine that
    blocked its rows on the waiting trajectory would see none end: the tool would give up, the test fail."""
    others_done, began = threading.Semaphore(0), threading.Event()
    gave_up = []

    def tool(key, n):
        if (key, n) == (0, 1):
            began.set()
            gave_up.append(not all(others_done.acquire(timeout=PATIENCE_S) for _ in range(3)))

    class Watched(ToolSource):
        def done(self, turn, tokens, logprobs):
            super().done(turn, tokens, logprobs)  # recorded first: the tool's "back" comes after this "done"
            if turn.key != 0 and began.is_set():
                others_done.release()

    source = Watched(prompts_of([4, 9, 6], seed=2), turns=3, budgets=(6,), tool=tool)
    eng = FastGen(model, 3, 64, 8, EngineOptions(bucket=8, check_every=2))
    source.queue[0].budget = 1  # trajectory 0's first turn ends first, the others' run on
    stats = eng.generate_turns(source, GREEDY, [], PAD, refill_min=1)  # no EOS: the budgets set the lengths
    assert gave_up == [False]
    ev = source.events
    began_at, back_at = ev.index(("tool", 0)), ev.index(("back", 0))
    during = ev[began_at:back_at]
    assert sum(e == "done" and k != 0 for e, k in during) >= 3, ev
    assert any(e == "start" and k != 0 for e, k in during), ev  # other trajectories' next turns took rows meanwhile
    assert stats["turns"] == 9 and stats["idle_row_steps"] > 0  # rows stood free while 0 waited: counted


# continuous batching's refills as recorded before it served turn sources: (decode steps before, rows, width) for
# the run below (no EOS: the budgets alone set the lengths, so the schedule is the same on every machine)
OLD_SCHEDULE = [(0, [0, 1, 2], 32), (6, [1, 2, 3], 40), (15, [0, 1, 2], 40), (21, [0, 1, 3], 32), (24, [0], 16)]


def test_a_prompt_list_and_a_source_of_its_prompts_refill_as_continuous_batching_did(model):
    """The prompt list is one turn source through the one loop: generate_many refills its rows on the schedule it
    had before turn sources (a multiple of refill_min rows while more prompts wait, widths rounded to 16), and the
    same prompts as one-turn trajectories of a TurnSource take the same schedule, sampled tokens, log-probs and
    random numbers."""
    prompts = prompts_of([4, 19, 2, 34, 7, 11, 3, 40, 5, 1, 23, 6, 8], seed=8)
    limits = [12, 3, 7, 1, 9, 12, 2, 5, 11, 4, 6, 10, 8]
    cfg = SamplingConfig(temperature=0.7, top_p=0.9)
    eng = FastGen(model, 4, 40, 12, EngineOptions(check_every=3))
    schedule, steps = [], [0]
    start, decode = eng._start_rows, eng._decode
    eng._start_rows = lambda rows, ids, *a: (schedule.append((steps[0], rows.tolist(), ids.shape[1])),
                                             start(rows, ids, *a))
    eng._decode = lambda *a: (steps.__setitem__(0, steps[0] + 1), decode(*a))

    def run(generate):
        schedule.clear()
        steps[0] = 0
        torch.manual_seed(3)
        out = generate()
        return out, list(schedule), eng.last_stats, torch.rand(4)

    (responses, logprobs), listed, listed_stats, after_list = run(
        lambda: eng.generate_many(prompts, cfg, [], PAD, limits=limits, refill_min=3))
    assert listed == OLD_SCHEDULE and [len(r) for r in responses] == limits
    source = ToolSource(prompts, turns=1)
    for turn, n in zip(source.queue, limits):
        turn.budget = n
    _, served, served_stats, after_source = run(lambda: eng.generate_turns(source, cfg, [], PAD, refill_min=3))
    assert served == OLD_SCHEDULE
    by_key = sorted(source.finished, key=lambda f: f[0].key)
    assert [t for _, t, _ in by_key] == responses and [lp for _, _, lp in by_key] == logprobs
    assert torch.equal(after_source, after_list)
    same = ("steps", "refills", "refill_shapes", "tokens", "occupancy", "turns", "waits", "idle_row_steps")
    assert {k: served_stats[k] for k in same} == {k: listed_stats[k] for k in same}


def test_a_context_longer_than_the_engine_is_refused_naming_the_trajectory(model):
    eng = FastGen(model, 2, 16, 4, EngineOptions(check_every=2))
    source = ToolSource([[9] * 17], turns=1)
    source.queue[0].key = 5
    with pytest.raises(ValueError, match="trajectory 5 has a context of 17 tokens > the engine's max_prompt_len 16"):
        eng.generate_turns(source, GREEDY, [EOS], PAD)


def test_sample_turns_builds_the_engine_for_the_longest_context_and_reuses_it(tiny_kit):
    """The rollout's entry: an engine whose prompt width is max_context (engine_for's cache, as ``sample`` uses it),
    the RolloutSpec's sampling, seeded; its set-up added to the timings; the stats returned."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verlflow.core.blueprint import RolloutSpec
    from verlflow.core.ml import fastgen

    tok = AutoTokenizer.from_pretrained(tiny_kit["model_dir"])
    m = AutoModelForCausalLM.from_pretrained(tiny_kit["model_dir"]).eval()
    cfg = RolloutSpec(temperature=1.0, top_p=0.9, max_new_tokens=6, micro_batch_size=2, engine="static")
    runs, timings = [], {}
    for _ in range(2):
        source = ToolSource(prompts_of([5, 8, 3], seed=1), turns=2, budgets=(6, 4))
        stats = fastgen.sample_turns(m, tok, source, cfg, torch.device("cpu"), 7, max_context=40, timings=timings)
        runs.append([(f[0].key, f[1], f[2]) for f in source.finished])
        assert stats["turns"] == 6 and all(0 < len(f[1]) <= 6 for f in source.finished)
    assert runs[0] == runs[1] and timings["setup_s"] > 0
    eng = fastgen.engine_for(m, 2, 40, 6)
    assert (eng.B, eng.max_prompt, eng.max_new) == (2, 40, 6)
    assert fastgen.engine_for(m, 2, 30, 6) is eng  # a narrower context reuses it

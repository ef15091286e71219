"""Agent-mode rollout throughput against single-turn, at the same model-token count (issue 40).

One process, random weights at a Qwen2.5 shape (nothing is downloaded), the static engine with continuous batching.
Single-turn: N prompts x (turns x turn_tokens) new tokens. Agent mode: N trajectories of `turns` model turns of
`turn_tokens` each (a random-init model almost never samples EOS, so every turn runs to its budget), through the
real AgentLoop (core/agent/loop.py) with an environment that sleeps `latency` per tool call and answers a short
observation. tok/s counts model tokens only, over the wall time without the engine's set-up; each run is done twice
and the second is reported (the first pays compiles and graph captures).

    python infra/bench/agent.py                       # GPU: 1.5B shape, 512 samples, 4 turns x 256 tokens
    python infra/bench/agent.py --smoke               # CPU-sized (the test suite runs this)

The tokenizer (chat template with tools) is the tiny calculator kit's; ids past its vocabulary decode to nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rollout import build_model, say  # noqa: E402

from verlflow.core.agent.env import Environment, Step  # noqa: E402
from verlflow.core.agent.loop import AgentLoop, Limits  # noqa: E402

TOOL = {"type": "function", "function": {"name": "lookup", "description": "Looks a value up.",
                                         "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}


class SleepEnv(Environment):
    """Every model turn is a tool call that takes `latency_s` and answers a short observation; done after
    `turns` model turns."""

    def __init__(self, config: dict, context=None):
        self.latency_s, self.turns, self.seen = config["latency_s"], config["turns"], 0

    def tools(self) -> list[dict]:
        return [TOOL]

    def step(self, model_text: str) -> Step:
        self.seen += 1
        if self.seen >= self.turns:
            return Step(None, reward=1.0, done=True)
        time.sleep(self.latency_s)
        return Step("value: 42", info={"tool_calls": 1})


def rollout_cfg(rows: int, new_tokens: int):
    return SimpleNamespace(temperature=1.0, top_p=1.0, top_k=0, micro_batch_size=rows, max_new_tokens=new_tokens,
                           weights="model", kv_cache="model")


def prompts(n: int) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": f"Question {i}: look the value of item {i} up, then answer."}]}
            for i in range(n)]


def single_turn(model, tok, args, dev) -> dict:
    from verlflow.core.ml import fastgen
    from verlflow.core.ml.generate import prompt_ids

    enc = [prompt_ids(tok, r["prompt"]) for r in prompts(args.samples)]
    cfg = rollout_cfg(args.rows, args.turns * args.turn_tokens)
    for _ in range(2):
        timings = {"setup_s": 0.0}
        t0 = time.perf_counter()
        out = fastgen.sample(model, tok, enc, cfg, dev, 0, timings=timings)
        wall = time.perf_counter() - t0 - timings["setup_s"]
    tokens = sum(len(r) for r in out)
    return {"mode": "single", "tokens": tokens, "wall_s": round(wall, 3), "tok_s": round(tokens / wall, 1),
            "prefill_tokens": sum(len(p) for p in enc)}


def agent(model, tok, args, dev, latency_s: float, turn_cache: bool) -> dict:
    import dataclasses

    from verlflow.core.ml import fastgen

    limits = Limits(max_turns=args.turns, max_total_tokens=args.max_context, max_new_tokens=args.turn_tokens,
                    tool_timeout_s=60.0)
    cfg = rollout_cfg(args.rows, args.turn_tokens)
    eng = fastgen.engine_for(model, args.rows, args.max_context, args.turn_tokens)  # the one sample_turns takes
    eng.options = dataclasses.replace(eng.options, turn_cache=turn_cache)
    for _ in range(2):
        loop = AgentLoop(tok, lambda: SleepEnv({"latency_s": latency_s, "turns": args.turns}), prompts(args.samples),
                         limits, ordered=False, max_prompt_len=args.max_context)
        timings = {"setup_s": 0.0}
        t0 = time.perf_counter()
        stats = fastgen.sample_turns(model, tok, loop, cfg, dev, 0, args.max_context, timings=timings)
        wall = time.perf_counter() - t0 - timings["setup_s"]
        loop.shutdown(timeout=5)
    recs = loop.records()
    tokens = sum(sum(t.loss_mask) for t in recs)
    return {"mode": "agent" + (", turn cache" if turn_cache else ", prefilled"), "latency_ms": int(latency_s * 1e3),
            "tokens": tokens, "wall_s": round(wall, 3),
            "tok_s": round(tokens / wall, 1), "turns_mean": sum(t.turns for t in recs) / len(recs),
            "context_tokens": sum(len(t.prompt_ids) + len(t.response_ids) for t in recs),
            "wait_s": round(loop.wait_s, 3), "occupancy": round(stats.get("occupancy", 0.0), 3),
            "refills": stats.get("refills"), "prefill_s": round(stats.get("prefill_s", 0.0), 3),
            "decode_s": round(stats.get("decode_s", 0.0), 3), "steps": stats.get("steps"),
            "prefill_tokens": stats.get("prefilled_slots", 0), "resumed": stats.get("resumed", 0),
            "forced_tokens": stats.get("forced_tokens", 0), "evicted": stats.get("evicted", 0),
            "idle_row_steps": stats.get("idle_row_steps", 0)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="1.5b")
    ap.add_argument("--samples", type=int, default=512)
    ap.add_argument("--rows", type=int, default=256, help="the engine's rows (rollout.micro_batch_size)")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn-tokens", type=int, default=256)
    ap.add_argument("--latency-ms", default="0,50,500")
    ap.add_argument("--turn-cache", default="on,off", help="the engine's turn cache in agent mode: on, off or both")
    ap.add_argument("--smoke", action="store_true", help="CPU-sized: tiny shape, 8 samples, 3 turns of 4 tokens")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.smoke:
        args.shape, args.samples, args.rows, args.turns, args.turn_tokens, args.latency_ms = "tiny", 8, 4, 3, 4, "0,50"
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    from transformers import AutoTokenizer

    from verlflow.core.testing.tinykit import make_tiny

    with tempfile.TemporaryDirectory() as kit:
        make_tiny(kit, task="calculator")
        tok = AutoTokenizer.from_pretrained(Path(kit) / "model")
    model, _, _ = build_model(args.shape, dtype, dev)
    # room for the prompt (< 128 tokens with the tool schema), every turn and every observation
    args.max_context = 128 + args.turns * (args.turn_tokens + 32)
    res = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "shape": args.shape,
           "samples": args.samples, "rows": args.rows, "turns": args.turns, "turn_tokens": args.turn_tokens,
           "runs": [single_turn(model, tok, args, dev)]}
    say(json.dumps(res["runs"][-1]))
    for ms in (float(x) for x in args.latency_ms.split(",")):
        for cache in args.turn_cache.split(","):
            res["runs"].append(agent(model, tok, args, dev, ms / 1e3, cache == "on"))
            res["runs"][-1]["vs_single"] = round(res["runs"][-1]["tok_s"] / res["runs"][0]["tok_s"], 3)
            say(json.dumps(res["runs"][-1]))
    say(f"| mode | tool latency | model tokens | prefilled slots | turns resumed | wall s | tok/s | vs single-turn |  "
        f"({res['device']}, {args.shape}, "
        f"{args.samples} samples, {args.rows} rows, {args.turns} turns x {args.turn_tokens} tokens)")
    for r in res["runs"]:
        say(f"| {r['mode']} | {r.get('latency_ms', '-')} ms | {r['tokens']:,} | {r['prefill_tokens']:,} | {r.get('resumed', '-')} | {r['wall_s']} | "
            f"{r['tok_s']:,.0f} | "
            f"{r.get('vs_single', 1.0):.2f} |")
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()

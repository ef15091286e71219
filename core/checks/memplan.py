"""A memory plan per GPU, made before anything is built: each stage's peak, term by term, from the model's shape,
the blueprint and the card's memory; the blueprint's `auto` settings chosen so that every stage fits.

Torch-free (a pure function of numbers): the validate stage prints the plan and refuses one that does not fit, with
the numbers and the setting to change; every stage worker resolves the `auto` settings with the same function and
the same numbers (`resolved`), so all stages of a run agree. The numbers are the card's capacity, not its free
memory (which moves while a warm pool holds models): validate also checks that the plan's peak is free.

The terms, per GPU, at world size W (FSDP2 and FSDP1 FULL_SHARD/SHARD_GRAD_OP shard over W, HYBRID_SHARD over a
node, NO_SHARD not at all):
- policy weights: the parameters in model.dtype (the fp32 master weights), sharded; cpu_offload keeps them on the host.
- gradients and AdamW state: the trained parameters' (model.lora: the adapters'), sharded, in model.dtype (AdamW's
  moments take their parameter's dtype), two moments; fsdp.defer_grad_sync adds the unsharded gradients in the
  compute dtype. The optimizer state exists from the first optimizer step on.
- the reference: a second sharded copy of the weights (model.lora: none, the base with adapters off).
- gathered weights: fsdp.reshard_after_forward false keeps every layer's weights unsharded in the compute dtype from
  forward to backward; true, about two layers and the root (embeddings, head) at a time.
- activations per token of an update micro-batch (ppo_max_token_len_per_gpu tokens): per decoder layer and token
  ACT[mode] = a_h x hidden + a_kv x kv width + a_i x intermediate elements of the compute dtype. Eager: measured on
  CPU (tests/test_memplan.py holds it to a tiny Qwen2's saved tensors). Compiled (fsdp.compile): inductor saves
  fewer, measured on the GPU (infra/bench/RESULTS.md). Activation checkpointing keeps each layer's inputs only (its
  hidden state, the rotary tables), plus one layer's activations recomputed in the backward. A micro-batch holds
  at most a rank's share of a mini-batch.
- the log-prob head: without fused kernels the micro-batch's [tokens, vocab] logits in the compute dtype, their fp32
  copy and the log-softmax (and its gradient); with fused kernels a few fp32 numbers a token and, for the torch
  backend, one chunk's fp32 logits.
- the rollout: the unsharded inference copy (the compute dtype), the static engine's own fused copies of the
  projections (or their fp8 copies), its KV cache (rows x (data.max_prompt_length + new tokens + 1) slots x layers
  x 2 x kv width: the longest prompt bounds it) and its work buffers (a prefill chunk's activations, the rows'
  sampling logits).
- resources.warm_workers: the pool keeps the policy, its optimizer state, its gradients (allocated until the next
  zero_grad) and the reference (with its weights left gathered by its forward-only pass when
  reshard_after_forward is false), and the critic, from the update into the next stages; and the inference copy
  with its engine (KV cache included) from the rollout into the update. The first rollout (from the build's
  policy) has only the policy's weights beside it. Measured against torch.cuda.max_memory_allocated per stage on
  an H100: infra/bench/RESULTS.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from verlflow.core.errors import VerlflowError

GiB = 2**30
HEADROOM = 0.90  # of the card's capacity: the caching allocator's fragmentation, the CUDA context, NCCL's buffers
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "fp32": 4, "bf16": 2, "fp16": 2}
# Activations saved for the backward per decoder layer and token, in elements of the compute dtype:
# (a_h, a_kv, a_i) x (hidden, kv width, intermediate).
ACT = {
    "eager": (11.0, 2.0, 4.0),  # HF's decoder layer: norms' fp32 inputs, q/k/v, attention out, gate/up/act/product
    "compiled": (8.0, 2.0, 3.0),  # inductor's partitioner recomputes the norms' and SwiGLU's pointwise work
}
FUSED_TORCH_CHUNK = 512  # tokens per chunk of verl's FusedLinearForPPO (its default, which core/ml/fusedhead.py keeps)
UNFUSED_HEAD = 3  # fp32 words per token x vocab the plain head keeps: the fp32 logits, log-softmax, its gradient
FORWARD_ONLY = (4.0, 3.0)  # a forward-only pass's transient work per token (hidden, intermediate elements)
PREFILL_TOKENS = 32768  # the static engine's prefill chunk (core/ml/fastgen/options.py prefill_tokens)
BUDGET_PREFERRED = 32768  # the update's token budget auto starts from (RESULTS.md: 43 % MFU against 40.6 % at 16k)
BUDGET_KEEP_AC_OFF = 16384  # auto lowers the budget to this before it turns activation checkpointing on
BUDGET_STEP = 1024
# rollout rows auto starts from (capped at the rank's samples per iteration): one GPU's 1,280 samples in 2 waves,
# not 5; past ~200 rows at 1.5B a decode step reads more KV cache than weights, so more rows gain less
ROWS_PREFERRED = 640
ROWS_MIN = 8


@dataclass(frozen=True)
class Shape:
    """What the plan needs of the model: parameter counts (exact, from the safetensors headers) and its dims."""
    params: int
    trainable: int
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    embed: int  # the input embedding's numel (+ the head's when untied): the root unit FSDP gathers apart

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        return max(0, self.params - self.embed) // max(self.layers, 1)

    @classmethod
    def of(cls, model_dir: Path | str, lora=None) -> "Shape":
        from verlflow.core.checks.footprint import ModelSize

        model_dir = Path(model_dir)
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
        config = {**config, **(config.get("text_config") or {})}
        size = ModelSize.of(model_dir)
        dims = _dims(config)
        embed = dims["vocab"] * dims["hidden"] * (1 if config.get("tie_word_embeddings", True) else 2)
        params = size.numel or _params_from_config(dims, embed)  # a folder with config.json alone: random weights
        trainable = size.adapters(lora).numel if lora is not None and size.linears else params
        if lora is not None and not size.linears:
            trainable = _lora_from_config(dims, lora)
        return cls(params=params, trainable=trainable, embed=embed, **dims)


def _dims(config: dict) -> dict:
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    return {"hidden": hidden, "layers": int(config["num_hidden_layers"]),
            "intermediate": int(config.get("intermediate_size") or 4 * hidden), "heads": heads,
            "kv_heads": int(config.get("num_key_value_heads") or heads),
            "head_dim": int(config.get("head_dim") or hidden // heads), "vocab": int(config["vocab_size"])}


def _params_from_config(d: dict, embed: int) -> int:
    q, kv = d["heads"] * d["head_dim"], d["kv_heads"] * d["head_dim"]
    layer = d["hidden"] * (q + 2 * kv) + q * d["hidden"] + 3 * d["hidden"] * d["intermediate"] + 2 * d["hidden"]
    return embed + d["layers"] * layer + d["hidden"]


def _lora_from_config(d: dict, lora) -> int:
    q, kv, h, i = d["heads"] * d["head_dim"], d["kv_heads"] * d["head_dim"], d["hidden"], d["intermediate"]
    mods = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, i),
            "up_proj": (h, i), "down_proj": (i, h)}
    hit = mods if "all-linear" in lora.target_modules else {k: v for k, v in mods.items() if k in lora.target_modules}
    return d["layers"] * sum(lora.rank * (a + b) for a, b in hit.values())


# ------------------------------------------------------------------------------------------------------ settings


@dataclass(frozen=True)
class Choice:
    """The three settings `auto` may choose, as concrete values."""
    activation_checkpointing: bool
    token_budget: int  # the update's real tokens per micro-batch on one rank
    rows: int  # the rollout engine's rows at once

    def fields(self) -> dict:
        return {"fsdp.activation_checkpointing": self.activation_checkpointing,
                "algorithm.ppo_max_token_len_per_gpu": self.token_budget, "rollout.micro_batch_size": self.rows}


AUTO_FIELDS = ("fsdp.activation_checkpointing", "algorithm.ppo_max_token_len_per_gpu", "rollout.micro_batch_size")


def auto_fields(bp) -> list[str]:
    return [f for f in AUTO_FIELDS if _get(bp, f) == "auto"]


def _get(bp, dotted: str):
    if dotted.startswith("phases["):  # phases[<i>].algorithm.<name>
        index, name = dotted[len("phases["):].split("].algorithm.")
        return getattr(bp.phases[int(index)].algorithm, name)
    section, name = dotted.split(".")
    return getattr(getattr(bp, section), name)


def seq_len(bp) -> int:
    """A sample's tokens at most: its prompt and response, or in agent mode the trajectory's whole budget."""
    if bp.rollout.agent is not None:
        return bp.rollout.agent.max_total_tokens
    return bp.data.max_prompt_length + bp.rollout.max_new_tokens


def lane_worlds(bp) -> tuple[int, int]:
    """(the rollout's ranks, the training stages' ranks): the whole world, or rollout.async's two lanes of the node.
    The plan sizes each side by its own ranks and lays both sides' terms on one card, an upper bound of either."""
    res, a = bp.resources, bp.rollout.async_
    if a is None:
        return res.world_size, res.world_size
    rollout, train = a.split(res.nproc_per_node)
    return max(1, rollout) * res.nnodes, max(1, train) * res.nnodes


def samples_per_rank(bp) -> int:
    return max(1, bp.data.batch_size * bp.rollout.n // lane_worlds(bp)[0])


def mini_batch_tokens(bp) -> int:
    """The most tokens a micro-batch can hold: a rank's share of a mini-batch, every sample at its longest."""
    return max(1, bp.algorithm.ppo_mini_batch_size * bp.rollout.n // lane_worlds(bp)[1]) * seq_len(bp)


def given_budget(bp) -> int:
    """The update's tokens per micro-batch as the blueprint sets them (auto aside): the packed budget, or
    ppo_micro_batch_size_per_gpu samples of the longest length (padded, or the packed default)."""
    a = bp.algorithm
    if a.use_remove_padding and isinstance(a.ppo_max_token_len_per_gpu, int):
        return a.ppo_max_token_len_per_gpu
    return a.ppo_micro_batch_size_per_gpu * seq_len(bp)


def _candidates(bp) -> list[Choice]:
    """Every combination `auto` may take, in the order of preference (the first that fits is chosen): the biggest
    rollout wave first (halving it costs a whole rollout's time), then the update without activation checkpointing
    at a token budget from 32k down to 16k, then with it from 32k down, then without it below 16k."""
    a, f, r = bp.algorithm, bp.fsdp, bp.rollout
    floor = seq_len(bp) if a.use_remove_padding else given_budget(bp)  # a packed micro-batch holds a whole sample
    if r.micro_batch_size == "auto":
        top = min(ROWS_PREFERRED, samples_per_rank(bp))
        rows = sorted({max(ROWS_MIN, top >> k) for k in range(12) if (top >> k) >= 1}, reverse=True)
        rows = [n for n in rows if n <= top] or [top]
    else:
        rows = [r.micro_batch_size]
    if a.ppo_max_token_len_per_gpu == "auto" and a.use_remove_padding:
        high = list(range(max(BUDGET_PREFERRED, floor), floor - 1, -BUDGET_STEP))
        budgets_off = [b for b in high if b >= min(BUDGET_KEEP_AC_OFF, high[0])]
        budgets_low = [b for b in high if b not in budgets_off]
    else:
        high = budgets_off = [given_budget(bp)]
        budgets_low = []
    acs = [False, True] if f.activation_checkpointing == "auto" else [bool(f.activation_checkpointing)]
    order = [(ac, b) for ac in acs for b in (budgets_off if not ac else high)]
    if False in acs:
        order += [(False, b) for b in budgets_low]
    return [Choice(ac, b, n) for n in rows for ac, b in order]


def _fixed(bp) -> Choice:
    """The blueprint's own values, `auto` read as the most preferred candidate (for the plan of a refusal)."""
    return _candidates(bp)[0]


# ------------------------------------------------------------------------------------------------------ the terms


@dataclass(frozen=True)
class Term:
    name: str
    bytes: float
    note: str = ""


@dataclass(frozen=True)
class StagePlan:
    stage: str
    terms: tuple[Term, ...]

    @property
    def peak(self) -> float:
        return sum(t.bytes for t in self.terms)

    def term(self, name: str) -> Term:
        return next(t for t in self.terms if t.name == name)


def _shards(bp) -> int:
    f, res = bp.fsdp, bp.resources
    if f.version == 1 and f.sharding_strategy == "NO_SHARD":
        return 1
    if f.version == 1 and f.sharding_strategy == "HYBRID_SHARD":
        return res.nproc_per_node
    return lane_worlds(bp)[1]


def act_per_token(shape: Shape, compiled: bool, checkpointing: bool, cdt: int) -> float:
    """Bytes of activations an update micro-batch keeps for the backward, per token (all layers)."""
    a_h, a_kv, a_i = ACT["compiled" if compiled else "eager"]
    layer = (a_h * shape.hidden + a_kv * shape.kv_width + a_i * shape.intermediate) * cdt
    if not checkpointing:
        return shape.layers * layer
    # each layer's checkpointed inputs (its hidden state, the rotary cos and sin) + the layer being recomputed
    return shape.layers * (shape.hidden + 2 * shape.head_dim) * cdt + layer


def head_per_token(bp, shape: Shape, cdt: int) -> tuple[float, float]:
    """(bytes per token, bytes once) of the log-prob head in a training micro-batch."""
    a = bp.algorithm
    if not a.use_fused_kernels:
        return shape.vocab * (cdt + 4 * UNFUSED_HEAD), 0.0
    if a.fused_kernels_backend == "triton":
        return 4 * 8 + shape.hidden * 4, 0.0  # log-prob, entropy and their gradients; the hidden state's fp32 grad
    return 4 * 8 + shape.hidden * 4, FUSED_TORCH_CHUNK * shape.vocab * 4 * 3


def terms(bp, shape: Shape, choice: Choice) -> dict[str, StagePlan]:
    """Each stage's peak per GPU, term by term, with `choice` for the `auto` settings."""
    f, a, r = bp.fsdp, bp.algorithm, bp.rollout
    mdt, cdt = ITEMSIZE[bp.model.dtype], ITEMSIZE[f.mixed_precision]
    S = _shards(bp)
    on_gpu = 0 if f.cpu_offload else 1
    P, T = shape.params, shape.trainable
    lora = bp.model.lora is not None
    gae = a.adv_estimator == "gae"
    warm = bp.resources.warm_workers
    weights = Term("policy weights", on_gpu * P * mdt / S, f"{P / 1e9:.2f}B x {mdt} B / {S}")
    optim = Term("AdamW state", on_gpu * 2 * T * mdt / S, f"2 moments of {T / 1e6:.1f}M")
    grads = Term("gradients", on_gpu * T * mdt / S + (T * cdt if f.defer_grad_sync else 0),
                 "sharded" + (" + unsharded (defer_grad_sync)" if f.defer_grad_sync else ""))
    ref = Term("reference", 0 if lora else on_gpu * P * mdt / S, "none: the base with adapters off" if lora else "")
    critic = Term("critic", on_gpu * 4 * P * mdt / S if gae else 0, "weights, gradients, AdamW (gae)")
    keeps_gathered = f.version == 2 and not f.reshard_after_forward
    gathered_n = P if keeps_gathered else 2 * shape.layer_params + shape.embed
    gathered = Term("gathered weights", gathered_n * cdt,
                    "every layer, forward to backward" if keeps_gathered else "two layers and the root")
    # a forward-only pass does not reshard: the reference keeps its gathered weights after scoring
    ref_gathered = Term("reference, gathered", 0 if lora or not keeps_gathered else P * cdt,
                        "left unsharded by its forward-only pass")
    infer = Term("inference copy", P * cdt, "unsharded, " + f.mixed_precision)
    fused = Term("engine weights", engine_weights_bytes(bp, shape, cdt) if r.engine == "static" else 0,
                 {"fp8": "fp8 projections", "model": "fused q/k/v and gate/up copies"}.get(
                     r.weights, "fp8 projections or fused copies, the larger (weights auto)"))
    rows = min(choice.rows, samples_per_rank(bp))  # the engine takes no more rows than it has samples
    kv = Term("KV cache", kv_cache_bytes(bp, shape, rows, cdt),
              f"{rows} rows x {seq_len(bp) + 1} slots" if r.engine == "static" else
              f"{rows} rows x {seq_len(bp)} (transformers' cache)")
    engine = Term("engine buffers", engine_bytes(bp, shape, rows, cdt), "prefill chunk, sampling logits")
    tokens = min(choice.token_budget, mini_batch_tokens(bp))
    act = Term("activations", tokens * act_per_token(shape, f.compile, choice.activation_checkpointing, cdt),
               f"{tokens:,} tokens, checkpointing {'on' if choice.activation_checkpointing else 'off'}"
               f"{', compiled' if f.compile else ''}")
    per, once = head_per_token(bp, shape, cdt)
    head = Term("log-prob head", tokens * per + once, "fused " + a.fused_kernels_backend if a.use_fused_kernels
                else "fp32 logits over the vocabulary")
    # What a warm pool keeps from an update into the next stages (gradients stay allocated until the next
    # zero_grad), and from a rollout into the update (the inference copy and its engine, KV cache included).
    kept_train = (weights, optim, grads, ref, ref_gathered, critic) if warm else ()
    kept_rollout = (infer, fused, kv) if warm and r.engine == "static" else ()
    rollout = (*kept_train, infer, fused, kv, engine)
    # The update: its forward-only passes (old and reference log-probs) or its training micro-batches, whichever is
    # bigger, with the warm pool's rollout engine beside them.
    score = Term("log-prob pass", score_bytes(bp, shape, tokens, cdt), "forward only, its own token budget")
    work = (act, head) if act.bytes + head.bytes >= score.bytes else (score,)
    update = (weights, optim, grads, ref, ref_gathered, critic, *kept_rollout, gathered, *work)
    stages = {
        "build": (weights, ref, Term("load buffers", 2 * shape.layer_params * mdt + shape.embed * mdt,
                                     "a layer and the embeddings unsharded")),
        # the first rollout (and evaluation) from the build's policy: no optimizer state or reference kept yet
        "first rollout": (weights, infer, fused, kv, engine) if warm else (infer, fused, kv, engine),
        "rollout": rollout,
        "update": update,
    }
    if warm:
        # The export gathers the whole model (views of the one shard on one GPU) and copies it to the host a tensor
        # at a time, each cast on the device (checkpoint.copy_state_into): the largest is the embedding, in the
        # export dtype; with LoRA, a merged projection's fp32 temporaries (W, B @ A, their sum)
        export = ITEMSIZE.get(bp.storage.export_dtype, cdt)
        one = max(shape.vocab * shape.hidden * export, 3 * 4 * shape.intermediate * shape.hidden if lora else 0)
        stages["export"] = (*kept_train, *kept_rollout,
                            Term("export gather", P * mdt * (S - 1) / S, "the other ranks' shards, whole"),
                            Term("export copy", one, "one tensor at a time, cast on the device"))
    return {s: StagePlan(s, tuple(t for t in ts if t.bytes)) for s, ts in stages.items()}


def engine_weights_bytes(bp, shape: Shape, cdt: int) -> float:
    """The static engine's own copies of the projections: fused [q; k; v] and [gate; up] in the compute dtype, or
    (rollout.weights=fp8) every projection in e4m3 with a scale per output channel; auto plans for the larger."""
    h, q, kv, i = shape.hidden, shape.heads * shape.head_dim, shape.kv_width, shape.intermediate
    fp8 = shape.layers * (h * (q + 2 * kv) + q * h + 3 * h * i + 4 * (q + 2 * kv + h + 2 * i + h))
    model = shape.layers * (h * (q + 2 * kv) + 2 * h * i) * cdt
    return {"fp8": fp8, "model": model}.get(bp.rollout.weights, max(fp8, model))  # auto: either


def kv_cache_bytes(bp, shape: Shape, rows: int, cdt: int) -> float:
    r = bp.rollout
    slots = seq_len(bp) + (1 if r.engine == "static" else 0)
    per_slot = 2 * shape.kv_width * (1 if r.kv_cache == "fp8" else cdt) + (2 * shape.kv_heads * 4
                                                                           if r.kv_cache == "fp8" else 0)
    return shape.layers * rows * slots * per_slot


def engine_bytes(bp, shape: Shape, rows: int, cdt: int) -> float:
    """The rollout's transient work: a prefill chunk's forward (hidden and MLP intermediates of its tokens, its
    (rows, prompt, prompt) mask) and the rows' sampling logits (compute dtype and fp32) with their outputs."""
    P = bp.data.max_prompt_length
    chunk = min(PREFILL_TOKENS, rows * P)
    h, i = FORWARD_ONLY
    prefill = chunk * (h * shape.hidden + i * shape.intermediate) * cdt + (chunk // max(P, 1)) * P * P
    sampling = rows * (shape.vocab * (cdt + 8) + bp.rollout.max_new_tokens * 12)
    return prefill + sampling


def score_bytes(bp, shape: Shape, train_budget: int, cdt: int) -> float:
    """The forward-only log-prob pass: its own budget (log_prob_max_token_len_per_gpu, default twice the training
    budget), a layer's transient work per token and the head's output (the plain head's fp32 logits)."""
    a = bp.algorithm
    tokens = (a.log_prob_max_token_len_per_gpu or 2 * train_budget) if a.use_remove_padding else train_budget
    h, i = FORWARD_ONLY
    per = (h * shape.hidden + i * shape.intermediate) * cdt + 8
    if not a.use_fused_kernels:
        per += shape.vocab * (cdt + 4 * 2)
    return tokens * per + (FUSED_TORCH_CHUNK * shape.vocab * 4 * 2 if a.use_fused_kernels and
                           a.fused_kernels_backend == "torch" else 0)


# -------------------------------------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Plan:
    capacity: int  # bytes of the card (the CPU: a rank's share of the host's memory)
    device: str  # what the card is called
    choice: Choice
    stages: dict[str, StagePlan]
    chosen: tuple[str, ...] = ()  # the fields `auto` decided
    problem: str | None = None  # why it does not fit and what to change; None when it fits
    free: int | None = None  # bytes free on the card at validate, when asked

    @property
    def limit(self) -> float:
        return self.capacity * HEADROOM

    @property
    def peak(self) -> float:
        return max(s.peak for s in self.stages.values())

    @property
    def peak_stage(self) -> str:
        return max(self.stages.values(), key=lambda s: s.peak).stage

    @property
    def fits(self) -> bool:
        return self.problem is None

    def stage_peak(self, stage: str, from_build: bool = False) -> float | None:
        """The planned peak of a pipeline stage (evaluate: as the rollout; `from_build`: a rollout or evaluation of
        the build's policy, before any update)."""
        if stage in ("rollout", "evaluate"):
            stage = "first rollout" if from_build else "rollout"
        s = self.stages.get({"monolithic": "update"}.get(stage, stage))
        return None if s is None else s.peak

    def choices_text(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.choice.fields().items() if k in self.chosen) or "none"

    def summary(self) -> str:
        return (f"peak {gib(self.peak)} in {self.peak_stage} of {gib(self.limit)} usable on {self.device} "
                f"({gib(self.capacity)} x {HEADROOM:.0%}); auto chose {self.choices_text()}")

    def rows(self) -> list[list[str]]:
        """The table: a row per term, a column per stage (GiB)."""
        names = list(dict.fromkeys(t.name for s in self.stages.values() for t in s.terms))
        out = []
        for name in names:
            cells = [name]
            for s in self.stages.values():
                got = next((t for t in s.terms if t.name == name), None)
                cells.append(f"{got.bytes / GiB:.2f}" if got else "")
            note = next(t.note for s in self.stages.values() for t in s.terms if t.name == name)
            out.append(cells + [note])
        out.append(["peak"] + [f"{s.peak / GiB:.2f}" for s in self.stages.values()] + [f"usable {gib(self.limit)}"])
        return out

    def header(self) -> list[str]:
        return ["GiB per GPU"] + list(self.stages) + ["what"]

    def table(self) -> str:
        """The plan as a rich table (plain markdown where rich is missing)."""
        try:
            from rich.console import Console
            from rich.table import Table
        except ImportError:
            return self.markdown()
        t = Table(title=f"memory plan per GPU: {self.device}, {gib(self.capacity)}", title_justify="left")
        for i, h in enumerate(self.header()):
            t.add_column(h, justify="right" if 0 < i < len(self.header()) - 1 else "left")
        for row in self.rows():
            t.add_row(*row)
        console = Console(width=160, record=True, file=open("/dev/null", "w"))  # noqa: SIM115 - rendered, not shown
        console.print(t)
        return console.export_text()

    def markdown(self) -> str:
        lines = ["| " + " | ".join(self.header()) + " |", "|" + " --- |" * len(self.header())]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in self.rows()])

    def record(self) -> dict:
        """What a manifest keeps of the plan."""
        return {"device": self.device, "capacity_gib": round(self.capacity / GiB, 2),
                "usable_gib": round(self.limit / GiB, 2), "choices": self.choice.fields(), "chosen": list(self.chosen),
                "stages_gib": {s: round(p.peak / GiB, 2) for s, p in self.stages.items()},
                "terms_gib": {s: {t.name: round(t.bytes / GiB, 3) for t in p.terms} for s, p in self.stages.items()}}


def gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def plan(bp, shape: Shape, capacity: int, device: str = "GPU") -> Plan:
    """The first candidate (in the order of preference) whose every stage fits `capacity` x HEADROOM; if none does,
    the plan of the blueprint's own values with the problem: the numbers and the settings that would make it fit."""
    chosen = tuple(auto_fields(bp))
    limit = capacity * HEADROOM
    for choice in _candidates(bp):
        stages = terms(bp, shape, choice)
        if max(s.peak for s in stages.values()) <= limit:
            return Plan(capacity, device, choice, stages, chosen)
    choice = _fixed(bp)
    stages = terms(bp, shape, choice)
    out = Plan(capacity, device, choice, stages, chosen)
    return replace(out, problem=_refusal(bp, shape, out))


def _refusal(bp, shape: Shape, got: Plan) -> str:
    worst = max(got.stages.values(), key=lambda s: s.peak)
    big = sorted(worst.terms, key=lambda t: -t.bytes)[:4]
    head = (f"the memory plan does not fit {got.device}: {worst.stage} needs ~{gib(worst.peak)} per GPU ("
            + ", ".join(f"{t.name} {gib(t.bytes)}" for t in big) + f") against {gib(got.limit)} usable "
            f"({gib(got.capacity)} x {HEADROOM:.0%}).")
    return f"{head} {_fix(bp, shape, got.capacity)}"


def _fix(bp, shape: Shape, capacity: int) -> str:
    """The settings that would make it fit: the auto ones the blueprint fixed, else more GPUs, LoRA or offload."""
    loose = with_auto(bp)
    fixed = [f for f in AUTO_FIELDS if f not in auto_fields(bp)]
    if fixed:
        alt = plan(loose, shape, capacity)
        if alt.fits:
            changes = {k: v for k, v in alt.choice.fields().items() if k in fixed and v != _get(bp, k)}
            if changes:
                return ("Set " + ", ".join(f"{k}: {json.dumps(v)}" for k, v in changes.items())
                        + " (or auto: the plan then chooses what fits).")
    for world in (2, 4, 8, 16, 32, 64):
        if world <= bp.resources.world_size or bp.data.batch_size * bp.rollout.n % world:
            continue
        wider = loose.model_copy(update={"resources": loose.resources.model_copy(
            update={"nproc_per_node": world, "nnodes": 1})})  # the sums only: how the GPUs are spread is not asked
        if plan(wider, shape, capacity).fits:
            return (f"No setting of {', '.join(AUTO_FIELDS)} fits {bp.resources.world_size} GPU(s); {world} GPUs "
                    "would hold it (resources.nproc_per_node x nnodes), or train LoRA adapters (model.lora), or set "
                    "fsdp.cpu_offload: true.")
    return (f"No setting of {', '.join(AUTO_FIELDS)} fits; train LoRA adapters (model.lora), set fsdp.cpu_offload: "
            "true, or use cards with more memory.")


def with_auto(bp):
    return _with(bp, {f: "auto" for f in AUTO_FIELDS})


def _with(bp, values: dict):
    """A copy of the blueprint with dotted fields set (validated, as an override would be)."""
    out = bp.model_copy(deep=True)
    for dotted, v in values.items():
        section, name = dotted.split(".")
        setattr(getattr(out, section), name, v)
    return out


def apply(bp, choice: Choice):
    """The blueprint with its `auto` fields set to `choice`'s values (the others as they are)."""
    return _with(bp, {k: v for k, v in choice.fields().items() if _get(bp, k) == "auto"})


# ------------------------------------------------------------------------------------------------ on the rank


def card(device) -> tuple[int, str]:
    """(capacity bytes, name) of a stage's device: the CUDA card, or a rank's share of the host's memory."""
    import torch

    if getattr(device, "type", device) == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(device)
        return int(props.total_memory), props.name
    import os

    import psutil

    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return int(psutil.virtual_memory().total // ranks), f"cpu ({ranks} rank(s) on the host)"


def plan_for(bp, device) -> Plan:
    capacity, name = card(device)
    return plan(bp, Shape.of(bp.model.path, bp.model.lora), capacity, name)


def resolved(bp, device):
    """The blueprint a stage runs with: its `auto` fields set by the plan for this device (all stages of a run make
    the same plan: the same blueprint, model and card). Unchanged when nothing is auto. A plan that does not fit
    still resolves (its preferred values): validate is where it is refused."""
    if not auto_fields(bp):
        return bp
    return apply(bp, plan_for(bp, device).choice)


# ------------------------------------------------------------------------------------- a stage's memory, measured

_AT: dict = {}  # what the stage is working on when memory runs out (note())


def note(**what) -> None:
    """The work a stage is doing now (e.g. a micro-batch's tokens), named in an out-of-memory error."""
    _AT.clear()
    _AT.update(what)


# The settings that lower each stage's peak (the OOM error names them, with their values now and ones to try).
LOWER_DEFAULT = "more GPUs (resources.nproc_per_node), model.lora or fsdp.cpu_offload: true"
TRAINERS = ("update", "monolithic", "sft", "dpo")
RETRIED = ("update", "sft", "dpo")  # resources.oom_retry (monolithic, a whole run in one job, is not)
# What the out-of-memory error of a stage the runner will run again says (the runner reads it: the rank knows the
# resolved settings and their floor, the driver does not).
RETRYING = "resources.oom_retry: the stage runs again once with "


@dataclass(frozen=True)
class MicroBatch:
    """The setting that sizes a trainer stage's micro-batches: its dotted name, its value and its smallest."""
    field: str
    value: int
    floor: int
    divides: bool = False  # samples a rank splits its share into: the blueprint wants them to divide the share

    @property
    def half(self) -> int | None:
        """Half its value (not below its floor; a divisor of it where it `divides`, so it divides the share too);
        None where it is at its floor already."""
        half = max(self.floor, self.value // 2)
        if self.divides:
            half = max(d for d in range(1, half + 1) if self.value % d == 0)
        return half if half < self.value else None


def micro_batch(stage: str, bp, phase: int | None = None) -> MicroBatch | None:
    """What sizes a trainer stage's micro-batches (`bp` resolved): the update's packed token budget (a micro-batch
    holds a whole sample at least) or its samples per micro-batch (padded, or packed at the default budget, which
    is that many of the batch's longest sample); a phase's rows per micro-batch. None for other stages."""
    if stage in ("update", "monolithic"):
        a = bp.algorithm
        if a.use_remove_padding and isinstance(a.ppo_max_token_len_per_gpu, int):
            return MicroBatch("algorithm.ppo_max_token_len_per_gpu", a.ppo_max_token_len_per_gpu, seq_len(bp))
        return MicroBatch("algorithm.ppo_micro_batch_size_per_gpu", a.ppo_micro_batch_size_per_gpu, 1, True)
    if stage in ("sft", "dpo") and phase is not None:
        return MicroBatch(f"phases[{phase}].algorithm.micro_batch_size_per_gpu",
                          bp.phases[phase].algorithm.micro_batch_size_per_gpu, 1, True)
    return None


def at_half(bp, stage: str, phase: int | None) -> tuple[object, dict]:
    """The runner's one retry after an out-of-memory error (resources.oom_retry, JobSpec.oom_retry): the blueprint
    with the stage's micro-batches at half (the update's forward-only budget too, when set), and the metrics that
    record it. Only how the step is split changes: each micro-batch's loss is scaled by the whole mini-batch's
    size, so the gradients are the same up to the order of the sums."""
    mb = micro_batch(stage, bp, phase)
    out = bp.model_copy(deep=True)
    if mb.field.startswith("phases["):
        out.phases[phase].algorithm.micro_batch_size_per_gpu = mb.half
    else:
        setattr(out.algorithm, mb.field.split(".")[1], mb.half)
    if stage == "update" and (forward_only := bp.algorithm.log_prob_max_token_len_per_gpu):
        out.algorithm.log_prob_max_token_len_per_gpu = max(seq_len(bp), forward_only // 2)
    return out, {"oom_retries": 1, mb.field.rsplit(".", 1)[1]: mb.half}


def _lower(stage: str, job, bp) -> str:
    """The settings that lower `stage`'s peak, each with its value now and one to try."""
    mb = micro_batch(stage, bp, job.phase)
    tries = []
    if mb is not None:
        auto = " (auto's choice)" if _get(job.blueprint, mb.field) == "auto" and not job.oom_retry else ""
        tries.append(f"{mb.field} (now {mb.value}{auto}; " + (f"try {mb.half})" if mb.half else "its smallest)"))
    if stage in TRAINERS and bp.fsdp.activation_checkpointing is False:
        tries.append("fsdp.activation_checkpointing (now false; try true)")
    if stage in ("rollout", "evaluate"):
        rows = bp.rollout.micro_batch_size
        auto = " (auto's choice)" if job.blueprint.rollout.micro_batch_size == "auto" else ""
        tries.append(f"rollout.micro_batch_size (now {rows}{auto}; try {max(1, rows // 2)})")
    return " or ".join(tries) or LOWER_DEFAULT


def _retry(stage: str, job, bp) -> str:
    """What follows the error: the runner's retry at half (RETRYING), or why there is none."""
    mb = micro_batch(stage, bp, job.phase)
    if stage not in RETRIED or mb is None:
        return ""
    if job.oom_retry:
        return " This was the one retry, at half the micro-batch (resources.oom_retry)."
    if not bp.resources.oom_retry:
        return ""
    if mb.half is None:
        return f" No retry: {mb.field} is at its smallest ({mb.floor})."
    return f" {RETRYING}{mb.field}: {mb.half}."


class Watch:
    """A stage's memory: on a CUDA card what it started with (a warm pool's models), its peak and the plan's peak
    for it (the stage's metrics); on any device, an out-of-memory error becomes one that names the stage, its work,
    the peak, the card and the setting that lowers it."""

    def __init__(self, ctx):
        import torch

        self.ctx, self.torch = ctx, torch
        self.cuda = ctx.device.type == "cuda" and torch.cuda.is_available()
        self.metrics: dict = {}
        self.start = 0

    def __enter__(self):
        _AT.clear()
        if self.cuda:
            self.torch.cuda.reset_peak_memory_stats(self.ctx.device)
            self.start = self.torch.cuda.memory_allocated(self.ctx.device)
        return self

    def planned(self) -> float | None:
        try:
            inputs = self.ctx.job.inputs
            from_build = "build" in inputs and inputs.get("policy") == inputs["build"]
            return plan_for(self.ctx.job.blueprint, self.ctx.device).stage_peak(self.ctx.job.stage, from_build)
        except Exception:  # noqa: BLE001 - a model folder the plan cannot read: validate reports it
            return None

    def __exit__(self, kind, exc, tb):
        peak = self.torch.cuda.max_memory_allocated(self.ctx.device) if self.cuda else None
        if exc is None and self.cuda:
            planned = self.planned()
            self.metrics["memory"] = {"start_gib": round(self.start / GiB, 2), "peak_gib": round(peak / GiB, 2),
                                      "planned_gib": None if planned is None else round(planned / GiB, 2)}
        if isinstance(exc, self.torch.OutOfMemoryError):
            raise DeviceOutOfMemory(self.message(peak, self.planned(), exc)) from exc
        return False

    def message(self, peak: int | None, planned: float | None, exc) -> str:
        ctx = self.ctx
        capacity, name = card(ctx.device)
        stage = ctx.job.stage
        work = ", ".join(f"{k.replace('_', ' ')} {v:,}" if isinstance(v, int) else f"{k} {v}" for k, v in _AT.items())
        first = str(exc).splitlines()[0] if str(exc) else ""
        return (f"out of memory in {ctx.job.name} on rank {ctx.rank}, {name} ({gib(capacity)})"
                + (f": {gib(peak)} was allocated at the peak" if peak is not None else "")
                + (f" while working on {work}" if work else "")
                + (f"; the memory plan predicted {gib(planned)} for {stage}" if planned else "")
                + f". Lower it with {_lower(stage, ctx.job, ctx.bp)}.{_retry(stage, ctx.job, ctx.bp)}"
                + f" torch: {first}")


def watched(ctx) -> Watch:
    return Watch(ctx)


class DeviceOutOfMemory(VerlflowError):
    """A stage ran out of device memory: the message names the stage, its work, the peak, the card and the setting
    that lowers it (the launcher classifies it as OOM by its 'out of memory')."""

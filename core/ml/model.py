"""Loading an HF causal LM and wrapping it with FSDP (FSDP2 by default, FSDP1 with the tutorial's knobs)."""

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from verlflow.core.blueprint.sections import FSDPSpec, ModelSpec
from verlflow.core.errors import InputError
from verlflow.core.ml import packing

log = logging.getLogger("verlflow.model")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    """model.dtype's name for a torch dtype (DTYPES' first, long name)."""
    return next(name for name, d in DTYPES.items() if d == dtype)


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    if not tok.chat_template:
        raise InputError(f"{path}: the tokenizer has no chat_template; add one to tokenizer_config.json.")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def decoder_layer_class(model: nn.Module, name: str | None = None) -> type:
    """The class FSDP wraps one unit per instance of: `name`, else the model's _no_split_modules."""
    names = [name] if name else list(getattr(model, "_no_split_modules", None) or [])
    for n in names:
        for m in model.modules():
            if type(m).__name__ == n:
                return type(m)
    raise InputError(
        f"fsdp.wrap_class: no decoder-layer class found in {type(model).__name__} (looked for {names or 'nothing'}); "
        "set fsdp.wrap_class to the transformer block class name, e.g. Qwen2DecoderLayer."
    )


def build_module(model_dir: str | Path, spec: ModelSpec, *, critic: bool = False, meta: bool = False,
                 packed: bool = False, adapters: bool = False) -> nn.Module:
    """The HF model with the weights in `model_dir`; empty (meta) when `meta`, random when the folder has only a
    config (both to be filled by a checkpoint load). `packed`: attention over padding-free rows (core/ml/packing.py).
    `adapters`: the policy being trained, with spec.lora's adapters injected when there are any."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    cls = AutoModelForTokenClassification if critic else AutoModelForCausalLM
    attn = spec.attn_implementation
    if packed:
        attn = packing.register()
    kw = dict(dtype=DTYPES[spec.dtype], attn_implementation=attn, trust_remote_code=spec.trust_remote_code)
    config = AutoConfig.from_pretrained(str(model_dir), trust_remote_code=spec.trust_remote_code)
    if critic:
        # A one-label head without dropout, as verl builds its critic (HF's default 0.1 would make the values the
        # update trains differ from the ones its value clip is centred on).
        config.num_labels, config.classifier_dropout = 1, 0.0
        kw["config"] = config
    if meta or not any(Path(model_dir).glob("*.safetensors")):
        from accelerate import init_empty_weights

        ctx = init_empty_weights(include_buffers=False) if meta else contextlib.nullcontext()
        with ctx:
            model = cls.from_config(config, dtype=kw["dtype"], attn_implementation=kw["attn_implementation"])
        _cast_parameters(model, kw["dtype"])
        # Built on meta, a tied output layer (Qwen2.5-0.5B/1.5B) comes out untied (init_empty_weights re-creates
        # every registered parameter): the ranks would disagree on the parameter set and a checkpoint would miss
        # (or gain) the head's optimizer state. Tie outside the context, where assignment keeps the object.
        model.tie_weights()
    else:
        model = cls.from_pretrained(str(model_dir), **kw)
    model.config.use_cache = False
    if adapters and spec.lora is not None and not critic:
        from verlflow.core.ml import lora

        lora.inject(model, spec.lora, meta=meta)
    return model


def _cast_parameters(model: nn.Module, dtype) -> None:
    """The parameters in `dtype`, as from_pretrained gives them on the rank that loads the weights: from_config
    leaves a critic's backbone (AutoModelForTokenClassification builds it with AutoModel.from_config) in fp32, and
    FSDP then refuses the mixed dtypes or a checkpoint holds both. Buffers (rotary inv_freq) keep theirs, and so do
    the modules a model keeps in fp32."""
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ())
    for name, p in model.named_parameters():
        if p.is_floating_point() and p.dtype != dtype and not keep & set(name.split(".")):
            p.data = p.data.to(dtype)


def materialize(model: nn.Module, device) -> nn.Module:
    """Allocate a meta-built model's tensors on `device`, uninitialised. Buffers built for real at construction
    (rotary inv_freq) are not in any checkpoint, so they must survive."""
    buffers = {n: b.detach().clone() for n, b in model.named_buffers() if b.device.type != "meta"}
    model.to_empty(device=device)
    with torch.no_grad():
        for n, b in model.named_buffers():
            if n in buffers:
                b.copy_(buffers[n])
    return model


def inference_dtype(fsdp: FSDPSpec) -> torch.dtype:
    """Rollout samples in the dtype the policy computes in under FSDP (fsdp.mixed_precision), not the fp32
    master weights: the distribution the update's log-probs are taken from."""
    return DTYPES[fsdp.mixed_precision]


@dataclass
class ShardReport:
    units: int
    decoder_layers: int
    local_numel: int
    total_numel: int
    world: int

    @property
    def balance(self) -> float:
        """Local share of the parameters times world size: 1.0 is a perfect 1/world shard."""
        return self.local_numel * self.world / max(self.total_numel, 1)


def wrap_fsdp(model: nn.Module, f: FSDPSpec, device: torch.device, fused_head: str | None = None
              ) -> tuple[nn.Module, ShardReport]:
    """Shard `model` per decoder layer (+ root) and report how much of it this rank holds. `fused_head`: the
    backend of core/fusedhead's forward to install (algorithm.fused_head), None for none."""
    layer_cls = decoder_layer_class(model, f.wrap_class)
    layers = [m for m in model.modules() if isinstance(m, layer_cls)]
    total = sum(p.numel() for p in model.parameters())
    if f.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if fused_head is not None:
        from verlflow.core.ml import fusedhead

        # before wrapping: FSDP1's wrapper calls the inner module's forward
        fusedhead.install(model, fused_head)
    if f.compile:
        compile_layers(layers)
    if f.version == 2:
        model, units = _fsdp2(model, layers, f, device)
    else:
        model, units = _fsdp1(model, layer_cls, f, device)
    local = _local_numel(model)
    return model, ShardReport(units, len(layers), local, total, dist.get_world_size())


def compile_layers(layers: list[nn.Module], backend: str = "inductor") -> None:
    """torch.compile each decoder layer's forward only: FSDP's hooks stay outside the graph and parameter names keep
    no _orig_mod prefix, so checkpoints are the same with compile on or off. Micro-batches change length: a pre-hook
    marks those sizes dynamic (dynamic=True made every size symbolic: 4 s of tracing per graph on the H200)."""
    for layer in layers:
        layer.forward = torch.compile(layer.forward, backend=backend)
        layer.register_forward_pre_hook(_lengths_dynamic, with_kwargs=True)


# A decoder layer's inputs whose sizes change between micro-batches, and which of their dims do: rows and tokens
# (the packed row's tokens; the padded layout's rows and width), never the hidden or head size.
_VARYING = {"hidden_states": (0, 1), "position_ids": (0, 1), "attention_mask": (0, 1, 2, 3),
            "cu_seq_lens_q": (0,), "cu_seq_lens_k": (0,), packing.LENGTH_KW: (1,)}


def _lengths_dynamic(module, args, kwargs):
    """Forward pre-hook of a compiled decoder layer: one graph for every micro-batch length, with the model's own sizes
    static (maybe_: a size of 1 may still specialise)."""
    mark = torch._dynamo.maybe_mark_dynamic
    named = dict(kwargs, hidden_states=args[0]) if args else kwargs
    for name, dims in _VARYING.items():
        t = named.get(name)
        if isinstance(t, torch.Tensor):
            mark(t, tuple(d for d in dims if d < t.dim()))
    for t in kwargs.get("position_embeddings") or ():  # (cos, sin): [rows, tokens, head_dim]
        mark(t, (0, 1))


def _fsdp2(model, layers, f, device):
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kw = {"reshard_after_forward": f.reshard_after_forward}
    if f.mixed_precision != "fp32" or f.reduce_dtype != "fp32":
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=DTYPES[f.mixed_precision],
                                               reduce_dtype=DTYPES[f.reduce_dtype])
    if f.cpu_offload:
        kw["offload_policy"] = CPUOffloadPolicy()
    meta = any(p.device.type == "meta" for p in model.parameters())
    if not meta and not f.cpu_offload:
        model.to(device)
    for layer in layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    if meta:  # only the local shards are allocated
        materialize(model, "cpu" if f.cpu_offload else device)
    return model, len(layers) + 1


def _fsdp1(model, layer_cls, f, device):
    import functools

    from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    mp = None
    if f.mixed_precision != "fp32" or f.reduce_dtype != "fp32":
        mp = MixedPrecision(param_dtype=DTYPES[f.mixed_precision], reduce_dtype=DTYPES[f.reduce_dtype],
                            buffer_dtype=DTYPES[f.mixed_precision])
    prefetch = None if f.backward_prefetch == "NONE" else BackwardPrefetch[f.backward_prefetch]
    wrapped = FSDP(
        model,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={layer_cls}),
        sharding_strategy=ShardingStrategy[f.sharding_strategy],
        mixed_precision=mp,
        cpu_offload=CPUOffload(offload_params=f.cpu_offload),
        backward_prefetch=prefetch,
        forward_prefetch=f.forward_prefetch,
        use_orig_params=f.use_orig_params,
        # FSDP1 on CPU needs an explicit cpu device_id (checked on torch 2.13 with gloo).
        device_id=device if device.type == "cuda" else torch.device("cpu"),
    )
    units = sum(1 for m in wrapped.modules() if isinstance(m, FSDP))
    return wrapped, units


def _local_numel(model: nn.Module) -> int:
    """Parameters this rank holds: DTensor local shards (FSDP2); FSDP1's views/flat params are already local."""
    from torch.distributed.tensor import DTensor

    return sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())


def check_shards(rep: ShardReport, fsdp: FSDPSpec) -> list[str]:
    """The tutorial's verification: one unit per decoder layer + root, and ~1/world of the parameters here."""
    problems = []
    if rep.units != rep.decoder_layers + 1:
        problems.append(f"FSDP units {rep.units} != decoder layers {rep.decoder_layers} + 1 (root)")
    sharded = fsdp.sharding_strategy != "NO_SHARD" and rep.world > 1
    if sharded and not 0.75 <= rep.balance <= 1.25:
        problems.append(
            f"rank holds {rep.local_numel:,} of {rep.total_numel:,} parameters ({rep.balance:.2f} x 1/world, "
            f"world={rep.world}): FSDP is not sharding (the 'silent failure'); check the torch build and wrap policy"
        )
    return problems


def unwrap_config(model: nn.Module):
    return getattr(model, "module", model).config

"""Padding-free (packed) batches for the update stage: `algorithm.use_remove_padding`.

A rollout batch is left-padded prompts beside right-padded responses. Packed, the real tokens of every sample of a
micro-batch are one row, positions restart per sample, and attention is variable-length causal (flash varlen on
CUDA), so no FLOP is spent on padding and no sample attends into its neighbour. Only the logits that predict
response tokens are computed (HF's `logits_to_keep` with an index tensor).
"""

import inspect
import logging
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

log = logging.getLogger("verlflow.packing")

ATTN = "verlflow_varlen"
LENGTH_KW = "verlflow_max_len"  # the packed row's longest sample, as a (0, max_len) tensor (model_kwargs)


@dataclass
class Packed:
    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    cu_seqlens: torch.Tensor  # int32 [n + 1]
    max_len: int
    logit_idx: torch.Tensor  # [K]: packed positions whose logits predict a response token
    labels: torch.Tensor  # [K]
    rows: torch.Tensor  # [K]: where each of the K values goes in the [n, R] padded layout
    cols: torch.Tensor

    def to(self, device) -> "Packed":
        return Packed(**{k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in vars(self).items()})

    def model_kwargs(self) -> dict:
        # The longest sample travels as the width of an empty tensor (LENGTH_KW): fsdp.compile marks that width
        # dynamic with the token count, where an int would be specialised (a recompile whenever it changes).
        width = torch.empty(0, self.max_len, dtype=torch.int8, device=self.input_ids.device)
        return {"input_ids": self.input_ids, "position_ids": self.position_ids, "attention_mask": None,
                "cu_seq_lens_q": self.cu_seqlens, "cu_seq_lens_k": self.cu_seqlens, LENGTH_KW: width}

    def unpack(self, values: torch.Tensor, n: int, R: int) -> torch.Tensor:
        """[K] -> [n, R], zero where the response is padding (the masks exclude those anyway)."""
        out = values.new_zeros(n, R)
        return out.index_put((self.rows, self.cols), values)


def lengths(batch: dict) -> torch.Tensor:
    """Real tokens (prompt + response) per sample."""
    return batch["prompt_mask"].sum(1) + batch["response_mask"].sum(1)


def pack(batch: dict, idx) -> Packed:
    """The samples `idx` of a rollout batch as one padding-free row."""
    idx = torch.as_tensor(idx, dtype=torch.long)
    ids = torch.cat([batch["prompts"][idx], batch["responses"][idx]], 1)
    mask = torch.cat([batch["prompt_mask"][idx], batch["response_mask"][idx]], 1).bool()
    plen, rlen = batch["prompt_mask"][idx].sum(1), batch["response_mask"][idx].sum(1)
    lens = mask.sum(1)
    tokens = ids[mask]  # row-major: each sample's prompt then response, samples one after another
    cu = torch.zeros(len(idx) + 1, dtype=torch.long)
    cu[1:] = lens.cumsum(0)
    pos = torch.arange(len(tokens)) - torch.repeat_interleave(cu[:-1], lens)
    rows = torch.repeat_interleave(torch.arange(len(idx)), rlen)
    cols = torch.arange(len(rows)) - torch.repeat_interleave(rlen.cumsum(0) - rlen, rlen)
    logit_idx = cu[:-1][rows] + plen[rows] - 1 + cols
    return Packed(tokens[None], pos[None], cu.to(torch.int32), int(lens.max()), logit_idx,
                  tokens[logit_idx + 1], rows, cols)


def token_balanced(sizes: list[int], parts: int, *, equal_size: bool) -> list[list[int]]:
    """Positions 0..len(sizes)-1 split into `parts` groups of near-equal token sums (verl's Karmarkar-Karp)."""
    from verl.utils.seqlen_balancing import get_seqlen_balanced_partitions

    if parts == 1:
        return [list(range(len(sizes)))]
    return get_seqlen_balanced_partitions(list(sizes), parts, equal_size=equal_size)


def split(ids: list[int], sizes: dict[int, int], max_tokens: int,
          field: str = "algorithm.ppo_max_token_len_per_gpu", at_least: int = 1) -> list[list[int]]:
    """The samples `ids` in the fewest (but >= at_least) token-balanced micro-batches of <= max_tokens real tokens."""
    biggest = max(sizes[i] for i in ids)
    if biggest > max_tokens:
        raise ValueError(
            f"{field}={max_tokens} is below the longest sample ({biggest} tokens); "
            "raise it to at least the longest prompt + response."
        )
    n = min(len(ids), max(at_least, math.ceil(sum(sizes[i] for i in ids) / max_tokens)))
    while True:  # balanced partitions can overshoot the budget: add parts until none does
        parts = [[ids[j] for j in p] for p in token_balanced([sizes[i] for i in ids], n, equal_size=False)]
        if n == len(ids) or all(sum(sizes[i] for i in p) <= max_tokens for p in parts):
            return parts
        n += 1


def plan(ids: list[int], sizes: dict[int, int], world: int, rank: int, max_tokens: int,
         field: str = "algorithm.ppo_max_token_len_per_gpu") -> list[list[int]]:
    """This rank's micro-batches (lists of sample ids) of a mini-batch, token-balanced across ranks and within a
    rank. Every rank computes every rank's split, so all ranks run the same number of micro-batches (FSDP's
    collectives pair up) without communicating."""
    per_rank = [[ids[j] for j in p] for p in token_balanced([sizes[i] for i in ids], world, equal_size=True)]
    splits = [split(r, sizes, max_tokens, field) for r in per_rank]
    n = max(len(p) for p in splits)
    mine = splits[rank]
    # A rank that fits in fewer micro-batches splits again into as many as the busiest rank needs.
    return mine if len(mine) >= n or len(mine) == len(per_rank[rank]) else split(per_rank[rank], sizes, max_tokens,
                                                                                   field, at_least=n)


def varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, *, cu_seq_lens_q=None,
                     **kwargs):
    """HF attention interface over a packed row: query [1, Hq, T, D], key/value [1, Hkv, T, D] -> [1, T, Hq, D]."""
    if cu_seq_lens_q is None or LENGTH_KW not in kwargs:
        raise ValueError("packed attention needs cu_seq_lens_q and the longest sample (the update stage passes them: "
                         "Packed.model_kwargs in core/ml/packing.py)")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, H, D]
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        max_len = kwargs[LENGTH_KW].shape[1]  # a symbolic size under compile
        out = _flash_varlen(q.contiguous(), k.contiguous(), v.contiguous(), cu_seq_lens_q, max_len, scaling)
    else:
        out = _sdpa_per_sample(q, k, v, cu_seq_lens_q, scaling)
    return out[None], None


_VARLEN: tuple | None = None  # (torch's varlen_attn, its keyword names), set by register(): outside any graph


def _varlen() -> tuple:
    """torch's varlen_attn and its keyword names (they changed between torch 2.9 and 2.13). register() looks them up
    before the layers are compiled: traced, the lookup (inspect.signature) was part of every compile."""
    global _VARLEN
    if _VARLEN is None:
        from torch.nn.attention.varlen import varlen_attn

        _VARLEN = (varlen_attn, frozenset(inspect.signature(varlen_attn).parameters))
    return _VARLEN


def _flash_varlen(q, k, v, cu, max_len, scaling):  # max_len stays symbolic under compile
    varlen_attn, params = _VARLEN or _varlen()
    kw = {"scale": scaling}
    if "is_causal" in params:  # torch 2.9-2.11
        kw["is_causal"] = True
    else:
        kw["window_size"] = (-1, 0)
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, **kw)


@torch.compiler.disable  # a loop over the sample bounds: traced, a graph per distinct length (recompiles every batch)
def _sdpa_per_sample(q, k, v, cu, scaling):
    """Reference path (CPU, fp32): causal SDPA on each sample's slice."""
    bounds = cu.tolist()
    outs = []
    for s, e in zip(bounds[:-1], bounds[1:]):
        o = F.scaled_dot_product_attention(q[s:e].transpose(0, 1)[None], k[s:e].transpose(0, 1)[None],
                                           v[s:e].transpose(0, 1)[None], is_causal=True, scale=scaling,
                                           enable_gqa=k.shape[1] != q.shape[1])
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs)


def _no_mask(*args, **kwargs):
    return None  # varlen attention takes the sample boundaries from cu_seqlens, not a mask


def register() -> str:
    """Make `attn_implementation="verlflow_varlen"` known to transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN, varlen_attention)
    AttentionMaskInterface.register(ATTN, _no_mask)
    if torch.cuda.is_available():  # the flash path's kernel (CPU runs per-sample SDPA)
        _varlen()
    return ATTN

"""One rank's bytes under dense Adam, LoGRA and LoRA, from the blocks it holds
(``memory.inventory``).

Per method: bf16 weights (norm weights fp32, as megatron-core keeps them); dense Adam's
fp32 grad buffer and its fp32 main + Adam moments sharded over DP (megatron's distributed
optimizer); LoGRA's fp32 sketches (out x r, DP-reduced, whole), row states and fp32
masters sharded over DP by whole rows, projections
A (bf16 when exact); LoRA's adapters with dense Adam's state. Activations op by op (with or
without full recompute), times the microbatches the rank's pipeline stage keeps in flight
(1F1B: PP - stage). The optimizer step's transient is derived from the ops the step runs
(``step_transient``), predicted-KL control's probe passes (``kl_probe_bytes``), and the
peak is the model state plus the largest of them.
"""

from __future__ import annotations

from megatron_logra.kl.budget import CHUNK_TOKENS
from megatron_logra.logra.row_adam import DEFAULT_CHUNK_ROWS as CHUNK_ROWS
from megatron_logra.memory.inventory import ROLES, Local, model_of, rank_params


def _dp_owned_rows(block: Local, dp: int) -> int:
    """Rows a DP rank owns of a sketched weight (``logra.row_shards``: whole rows, each
    segment split when it divides, else not sharded)."""
    segments = [block.rows // 2] * 2 if block.gated else [block.rows]
    return block.rows // dp if all(s % dp == 0 for s in segments) else block.rows


def _projection_bytes(rank: int) -> int:
    """Bytes per entry of a stored A: bf16 when +-1/sqrt(r) is exact (r a power of 4)."""
    exact = rank & (rank - 1) == 0 and (rank.bit_length() - 1) % 2 == 0
    return 2 if exact else 4


def model_state(blocks: list[Local], dp: int, *, method: str, rank: int = 256,
                master: str = "fp32", targets: tuple[str, ...] = ROLES,
                untargeted: str = "frozen", lora_rank: int = 16) -> dict[str, float]:
    """Bytes by category of one rank's model state (what
    ``held_state.model_state_bytes`` counts on a live rank)."""
    dense_state = lambda n: (4 * n, 12 * n / dp)  # noqa: E731  fp32 grads; main, m, v
    out = {"params": sum((4 if b.role == "norm" else 2) * b.numel for b in blocks),
           "grads": 0.0, "dense_optimizer": 0.0}
    if method == "dense_adam":
        trained = sum(b.numel for b in blocks)
    elif method == "lora":
        adapted = [b for b in blocks if b.role in targets]
        trained = sum(lora_rank * (b.rows + b.cols) for b in adapted)  # A [r, in], B [out, r]
        out["params"] += 2 * trained
    else:
        sketched = [b for b in blocks if b.role in targets
                    or (b.role in ("embedding", "output") and "embedding" in targets)]
        rest = sum(b.numel for b in blocks if b not in sketched)
        trained = rest if untargeted == "adam" else 0
        # S rows: a column-parallel block's own rows; a row-parallel block's S is out x r
        out["logra_sketches"] = 4 * rank * sum(b.rows for b in sketched)
        out["logra_row_indices"] = sum(  # int64 global row and HF module of each row, and
            16 * b.rows + (8 * _dp_owned_rows(b, dp)  # the owned rows' modules (a copy
                           if b.gated and _dp_owned_rows(b, dp) < b.rows else 0)  # only
            for b in sketched)  # when a gated fc1's two halves are sharded)
        out["logra_row_states"] = 4 * sum(_dp_owned_rows(b, dp) for b in sketched)
        out["logra_masters"] = (4 * sum(_dp_owned_rows(b, dp) * b.cols for b in sketched)
                                if master == "fp32" else 0.0)
        out["logra_projections"] = _projection_bytes(rank) * rank * sum(b.cols
                                                                        for b in sketched)
    out["grads"], out["dense_optimizer"] = dense_state(trained)
    out["total"] = sum(out.values())
    return out


def layer_activation_bytes(arch, tp: int, *, method: str, rank: int, seq: int,
                           lora_rank: int = 16, frozen_norms: bool = False) -> float:
    """Bytes per token one layer's forward leaves saved for backward (no recompute, bf16).

    Counted op by op for this implementation (megatron local spec, unfused CPU/GPU path):
    torch RMSNorm saves its fp32 input copy, the rsqrt and, when its weight trains, the
    fp32 normalised value (the weight's gradient needs it; LoGRA and LoRA freeze the
    norms) (Qwen3's q/k norms too); RoPE its bf16 cos/sin for q and k; unfused attention q, k,
    v expanded to all heads, the fp32 softmax and its bf16 copy (a*s per token each);
    SwiGLU gate, up and silu(gate). The linears save their bf16 inputs (dense Adam; LoRA
    too, for its A, plus X A^T [r] per adapter) or only X A^T in bf16 (LoGRA: the weight
    gradient is sketched, and the input gradient needs no X).
    """
    h, hd = arch.hidden_size, arch.head_dim
    q = arch.num_attention_heads * hd
    per_element = 4 if frozen_norms else 8
    norms = 2 * (per_element * h + 4)
    if arch.qk_norm:
        norms += per_element * (q + arch.num_kv_heads * hd) / tp
    rope = 4 * 2 * hd
    attention = (3 * 2 * q + (4 + 2) * arch.num_attention_heads * seq) / tp
    mlp = 3 * 2 * arch.ffn_hidden_size / tp
    if method == "logra":
        linear_inputs = 4 * 2 * rank
    else:
        linear_inputs = 2 * 2 * h + 2 * (q + arch.ffn_hidden_size) / tp
        if method == "lora":
            linear_inputs += 4 * 2 * lora_rank
    return norms + rope + attention + mlp + linear_inputs


def activation_bytes(arch, tp: int, pp: int, stage: int, *, method: str, rank: int, seq: int,
                     mbs: int, microbatches: int, recompute: bool,
                     sketch_output: bool = False, frozen_norms: bool = False,
                     lora_rank: int = 16) -> float:
    """Peak activation bytes of pipeline stage ``stage`` (1F1B: PP - stage microbatches in
    flight, capped by the microbatch count; the last stage also holds the loss head).

    No recompute: every layer's saved tensors. Full recompute (megatron, one layer per
    checkpoint): each layer's bf16 input, plus one layer's saved tensors while its
    backward recomputes it. The head: final norm, the output layer's input (or X A^T),
    and the loss over this rank's vocab shard at its forward's peak: the bf16 logits, their
    fp32 copy and its contiguous copy (megatron's cross entropy then works in place on
    it: max, exp, and in backward the softmax becomes the gradient), 10 bytes per entry,
    4 more when padded vocab entries are masked (``training.loss.token_nll``)."""
    n = seq * mbs
    layers = arch.num_layers // pp
    layer = layer_activation_bytes(arch, tp, method=method, rank=rank, seq=seq,
                                   lora_rank=lora_rank, frozen_norms=frozen_norms)
    body = layers * layer if not recompute else layers * 2 * arch.hidden_size + layer
    in_flight = min(pp - stage, microbatches)
    total = in_flight * n * body
    if stage == pp - 1:
        output_input = 2 * rank if method == "logra" and sketch_output else 2 * arch.hidden_size
        final_norm = (4 if frozen_norms else 8) * arch.hidden_size + 4
        loss = 10 + (4 if arch.padded_vocab_size > arch.vocab_size else 0)
        total += n * (final_norm + output_input + loss * arch.padded_vocab_size / tp)
    return total


def step_transient(blocks: list[Local], dp: int, *, method: str, rank: int,
                   master: str, targets: tuple[str, ...]) -> float:
    """Peak bytes LoGRA's optimizer step allocates beyond the model state, from the ops it
    runs per sketched block (D is computed in place in the sketch buffers):

    - the factor's rounding (``optimizer._apply_all``): D x c as bf16, 2 rows r;
    - ||D A|| (``row_adam.update_sq_norm``): D (A A^T), 4 rows r, and A A^T, 4 r^2;
    - SR mode (``row_adam.apply_low_rank_update`` exact, ``rounding``): per row chunk of
      E = min(1024, rows) x cols elements, A in fp64 (8 r cols) and D's chunk in fp64
      (8 chunk r) stay alive while the fp64 product and its fp32 copy (12 E), then the
      fp32 sum, the int32 noise and its shifted copy (12 E) are;
    - fp32 master: one in-place GEMM on the master, A in fp32 (4 r cols), then the bf16
      weight copied in place.
    Dense Adam and LoRA: 0 (megatron's Adam updates its shards in place)."""
    if method != "logra":
        return 0.0
    worst = 0.0
    for b in blocks:
        if b.role not in targets:
            continue
        rows = _dp_owned_rows(b, dp) // (2 if b.gated else 1)  # a gated fc1: two pieces
        common = max(2 * rows * rank, 4 * rows * rank + 4 * rank * rank)
        if master == "none":
            chunk = min(CHUNK_ROWS, rows)
            apply = 8 * rank * b.cols + 8 * chunk * rank + 12 * chunk * b.cols
        else:
            apply = 4 * rank * b.cols
        worst = max(worst, common, apply)
    return worst


def kl_probe_bytes(arch, tp: int, pp: int, stage: int, *, rows: int, length: int,
                   response_tokens: int) -> float:
    """Peak bytes of predicted-KL control's probe passes beyond the model state
    (``kl.controller``: a forward-mode pass of ``rows`` probe sequences of ``length``
    tokens, ``response_tokens`` of each generated, then a plain forward), whichever is
    larger of:

    - a layer's unfused attention under forward AD (megatron-core's local spec, which the
      tangent needs): the bf16 scores and their tangent (4 bytes) and the softmax's fp32
      copies with their tangents at its peak (20 bytes, counted by tracing megatron-core
      0.16.1's ``forward_torch_softmax``: the dry run), and the scores' bf16 buffer (2),
      per entry of [rows, heads/TP, length, length];
    - on the last stage, the logits [length, rows, Vp/TP] and their tangent in bf16 and
      the [rows, length] copies GPTModel returns (8 bytes per entry), or those copies with
      the response rows of logits and tangent (4 bytes per response token and entry) and
      the fp64 temporaries of one chunk of the quadratic form (6 [256, Vp/TP] fp64)."""
    attention = 26 * rows * arch.num_attention_heads / tp * length ** 2
    if stage != pp - 1:
        return attention
    vocab = arch.padded_vocab_size / tp
    entries = rows * length * vocab
    responses = rows * min(length, response_tokens) * vocab
    head = max(8 * entries, 4 * entries + 4 * responses + 48 * CHUNK_TOKENS * vocab)
    return max(attention, head)


def plan(shape: str, tp: int, pp: int, dp: int, *, method: str, rank: int = 256,
         master: str = "fp32", seq: int = 4096, mbs: int = 1, microbatches: int = 1,
         recompute: bool = True, targets: tuple[str, ...] = ROLES,
         untargeted: str = "frozen", lora_rank: int = 16,
         kl_probe: tuple[int, int, int] | None = None) -> dict:
    """Bytes of every pipeline stage's rank, and the busiest (model state; peak).
    ``kl_probe``: predicted-KL control's probe (rows, tokens, generated tokens of each;
    ``kl_probe_bytes``), None without the control."""
    arch, _ = model_of(shape)
    stages = []
    for stage in range(pp):
        blocks = rank_params(shape, tp, pp, stage)
        state = model_state(blocks, dp, method=method, rank=rank, master=master,
                            targets=targets, untargeted=untargeted, lora_rank=lora_rank)
        frozen_norms = method == "lora" or (method == "logra" and untargeted == "frozen")
        act = activation_bytes(arch, tp, pp, stage, method=method, rank=rank, seq=seq,
                               mbs=mbs, microbatches=microbatches, recompute=recompute,
                               sketch_output="embedding" in targets,
                               frozen_norms=frozen_norms, lora_rank=lora_rank)
        transient = step_transient(blocks, dp, method=method, rank=rank, master=master,
                                   targets=targets)
        kl = 0.0 if kl_probe is None else kl_probe_bytes(
            arch, tp, pp, stage, rows=kl_probe[0], length=kl_probe[1],
            response_tokens=kl_probe[2])
        stages.append({"model_state": state["total"], "state": state, "activations": act,
                       "step_transient": transient, "kl_probe": kl,
                       "peak": state["total"] + max(act, transient, kl)})
    return {"stages": stages, "model_state": max(s["model_state"] for s in stages),
            "peak": max(s["peak"] for s in stages)}

"""Updates per hour of RL on one GPU node: rollouts on vLLM engines, training on the rest.

Pure arithmetic (no torch, no devices). ``docs/throughput-model.md`` explains the model and
where each input comes from; ``benchmarks/throughput_model.py`` prints it for the paper's
1.5B and 7B settings. Units: seconds (s), bytes (B), FLOP, tokens; rates per second.

One update = generate the batch's responses (rollout), train on them (train), push the new
weights into every engine (push). The schedules:

- ``sync``: the trainer waits for the rollout and the engines wait for the training and
  the push:  update = rollout + train + push (+ sleep/wake when colocated).
- ``async`` (one step off): the engines generate batch k+1 with weights k while the
  trainer trains on batch k. The push updates the engines' weights in place, so it waits
  for the batch in flight:  update = max(rollout, train) + push.  A staged push (received
  while generating, swapped between batches) gives  update = max(rollout, train + push).

A rollout lasts as long as its slowest engine, and an engine's batch lasts as many decode
steps as its longest response. Each decode step is a roofline (weights and KV cache read
from HBM, or the batch's FLOPs, whichever is slower) plus a fixed per-step overhead (the
scheduler, kernel launches; large in vLLM's eager mode, which the paper's runs used).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from megatron_logra.memory.shapes import PAPER_SHAPES, shape_arch
from megatron_logra.model.arch import ModelArch

SCHEDULES = ("sync", "async")
PLACEMENTS = ("dedicated", "colocated")
ENGINE_TPS = (1, 2, 4, 8)


def matmul_params(model: ModelArch) -> int:
    """Weights one token multiplies by in a forward (q/k/v/o, gate/up/down, output layer):
    its forward costs 2 x this many FLOP."""
    h, q, kv = model.hidden_size, model.num_attention_heads * model.head_dim, \
        model.num_kv_heads * model.head_dim
    layer = 2 * h * q + 2 * h * kv + 3 * h * model.ffn_hidden_size
    return model.num_layers * layer + model.vocab_size * h


def weight_bytes(model: ModelArch) -> int:
    """bf16 weights (B): what an engine reads per decode step and a full push sends."""
    return 2 * model.num_parameters


def kv_bytes_per_token(model: ModelArch) -> int:
    """bf16 K and V of one token over all layers (B)."""
    return 2 * model.num_layers * model.num_kv_heads * model.head_dim * 2


def kv_bytes_per_token_per_gpu(model: ModelArch, tp: int) -> float:
    """One token's K and V on each of an engine's ``tp`` GPUs (B): vLLM splits the KV
    heads, and replicates them when TP exceeds their number."""
    return kv_bytes_per_token(model) * max(1.0, model.num_kv_heads / tp) / model.num_kv_heads


@dataclass(frozen=True)
class Workload:
    """One update's batch (token counts are means over the batch)."""

    prompts: int = 128  # prompts per update
    responses_per_prompt: int = 1
    prompt_tokens: float = 150.0  # mean prompt length (tokens)
    mean_response_tokens: float = 1000.0  # mean response length (tokens)
    # the batch's longest response (= its decode steps): the paper's cap, 4096 tokens of
    # prompt and response (max_total_sequence_length), less the prompt
    longest_response_tokens: float = 4096.0 - 150.0

    @property
    def sequences(self) -> int:
        return self.prompts * self.responses_per_prompt

    @property
    def trained_tokens(self) -> float:
        """Tokens the trainer runs per update (prompt and response, no padding)."""
        return self.sequences * (self.prompt_tokens + self.mean_response_tokens)


@dataclass(frozen=True)
class Hardware:
    """One GPU (defaults: H100 SXM 80 GB spec sheet) and its node's links."""

    memory_bytes: float = 80e9  # HBM (B)
    hbm_bytes_per_s: float = 3.35e12  # HBM bandwidth (B/s)
    peak_flop_per_s: float = 989e12  # dense bf16 tensor-core peak (FLOP/s)
    hbm_efficiency: float = 0.8  # share of the HBM bandwidth a decode step reaches
    allreduce_s: float = 10e-6  # one small all-reduce among an engine's TP ranks (s)


@dataclass(frozen=True)
class Efficiency:
    """How well the software uses the hardware: calibrated or assumed (see the docs)."""

    train_mfu: float = 0.05  # trainer FLOP / peak, for train_flop_factor FLOP per token
    #                          (paper_inputs calibrates it)
    step_overhead_s: float = 0.0  # fixed cost of one decode step (s; paper_inputs calibrates)
    train_flop_factor: float = 10.0  # FLOP per token per matmul weight: logprob pass 2,
    #                                   forward 2, recompute 2, backward 4
    prefill_mfu: float = 0.4  # prompt prefill FLOP / peak
    push_bytes_per_s: float = 25e9  # dedicated engines: NCCL push (B/s)
    colocated_push_bytes_per_s: float = 5e9  # colocated: gloo through host memory (B/s)
    push_latency_s: float = 0.5  # fixed cost of one push (s)
    switch_s: float = 2.0  # colocated: engine sleep + wake, trainer cache release (s/update)
    train_bytes_per_param: float = 16.0  # trainer model state: fp32 weight, grad, Adam m, v
    memory_fraction: float = 0.8  # share of a GPU the trainer's model state may take


@dataclass(frozen=True)
class Inputs:
    """Everything the model needs about one setting."""

    model: ModelArch  # its shape (``memory.shapes.shape_arch``)
    workload: Workload = Workload()
    hardware: Hardware = Hardware()
    efficiency: Efficiency = Efficiency()
    gpus: int = 8  # GPUs on the node
    name: str = "the model"  # in messages

    def __post_init__(self):
        w = self.workload
        if self.gpus < 1:
            raise ValueError(f"gpus={self.gpus}: a node needs at least 1 GPU (set gpus >= 1)")
        if w.sequences < 1:
            raise ValueError(f"prompts={w.prompts} x responses_per_prompt="
                             f"{w.responses_per_prompt}: an update needs at least one response")
        if not 0 < w.mean_response_tokens <= w.longest_response_tokens:
            raise ValueError(f"mean_response_tokens={w.mean_response_tokens} must be > 0 and <= "
                             f"longest_response_tokens={w.longest_response_tokens}")


@dataclass(frozen=True)
class Layout:
    """Where and when the engines and the trainer run."""

    schedule: str  # sync | async
    placement: str  # dedicated (GPUs of their own) | colocated (the trainer's GPUs, in turns)
    replicas: int  # engines; the batch's prompts are split over them
    engine_tp: int  # tensor-parallel GPUs per engine
    train_gpus: int  # the trainer's GPUs
    staged_push: bool = False  # async: the engines receive the push while generating

    @property
    def generate_gpus(self) -> int:
        return self.replicas * self.engine_tp


@dataclass(frozen=True)
class Timing:
    """One update of a layout (s) and what follows from it."""

    layout: Layout
    rollout_s: float  # the slowest engine's batch
    train_s: float
    push_s: float  # into every engine
    switch_s: float  # colocated only
    update_s: float

    @property
    def updates_per_h(self) -> float:
        return 3600.0 / self.update_s

    @property
    def trainer_wait(self) -> float:
        """Share of the update time the trainer has nothing to do."""
        return 1.0 - (self.train_s + self.push_s) / self.update_s

    @property
    def engine_wait(self) -> float:
        """Share of the update time the engines have nothing to do (a staged push is
        received while they generate)."""
        push = 0.0 if self.layout.staged_push else self.push_s
        return 1.0 - (self.rollout_s + push) / self.update_s


def min_train_gpus(inputs: Inputs) -> int:
    """GPUs the trainer's model state needs at the least (its state sharded over them)."""
    e, hw = inputs.efficiency, inputs.hardware
    return math.ceil(inputs.model.num_parameters * e.train_bytes_per_param
                     / (hw.memory_bytes * e.memory_fraction))


def engine_tp_fits(model: ModelArch, tp: int) -> bool:
    """vLLM's rule: TP divides the attention heads, and the KV heads divide TP or TP
    divides them."""
    kv = model.num_kv_heads
    return model.num_attention_heads % tp == 0 and (kv % tp == 0 or tp % kv == 0)


def check_layout(inputs: Inputs, layout: Layout) -> None:
    """ValueError naming the setting and the fix when the layout cannot run."""
    n, tp, gpus = layout.replicas, layout.engine_tp, inputs.gpus
    if layout.schedule not in SCHEDULES:
        raise ValueError(f"schedule {layout.schedule!r}: choose {' or '.join(SCHEDULES)}")
    if layout.placement not in PLACEMENTS:
        raise ValueError(f"placement {layout.placement!r}: choose {' or '.join(PLACEMENTS)}")
    if n < 1 or tp < 1 or layout.train_gpus < 1:
        raise ValueError(f"replicas={n}, engine_tp={tp}, train_gpus={layout.train_gpus}: "
                         "each must be >= 1")
    if n > inputs.workload.sequences:
        raise ValueError(f"replicas={n} > the {inputs.workload.sequences} responses of an "
                         "update: some engines would get none (lower the replicas)")
    if not engine_tp_fits(inputs.model, tp):
        raise ValueError(f"engine_tp={tp} does not split {inputs.name}'s "
                         f"{inputs.model.num_attention_heads} attention heads and "
                         f"{inputs.model.num_kv_heads} "
                         "KV heads (choose a TP that divides the heads, and divides or is a "
                         "multiple of the KV heads)")
    if layout.schedule == "async" and layout.placement == "colocated":
        raise ValueError("async with colocated engines: the engines generate while the "
                         "trainer trains, so they need GPUs of their own (use dedicated)")
    need = layout.generate_gpus + (layout.train_gpus if layout.placement == "dedicated" else 0)
    if layout.placement == "colocated" and layout.train_gpus > gpus:
        raise ValueError(f"train_gpus={layout.train_gpus} > the node's {gpus} GPUs")
    if need > gpus:
        what = (f"train_gpus {layout.train_gpus} + " if layout.placement == "dedicated"
                else "")
        raise ValueError(f"{what}replicas {n} x engine_tp {tp} = {need} GPUs > the node's "
                         f"{gpus} ({layout.placement}): lower the replicas, the engine TP"
                         + (" or the trainer's GPUs" if what else ""))
    if layout.train_gpus < min_train_gpus(inputs):
        raise ValueError(f"train_gpus={layout.train_gpus}: {inputs.name}'s trainer state "
                         f"needs >= {min_train_gpus(inputs)} GPUs (give the trainer more)")


def decode_step_s(inputs: Inputs, tp: int, batch: float, context: float) -> float:
    """One decode step of an engine on ``tp`` GPUs for ``batch`` sequences of ``context``
    tokens each (s): overhead + TP all-reduces + max(bytes / bandwidth, FLOP / peak)."""
    m, hw = inputs.model, inputs.hardware
    read = weight_bytes(m) / tp + batch * context * kv_bytes_per_token_per_gpu(m, tp)
    flop = 2.0 * matmul_params(m) * batch / tp
    roof = max(read / (hw.hbm_bytes_per_s * hw.hbm_efficiency), flop / hw.peak_flop_per_s)
    comm = 2 * m.num_layers * hw.allreduce_s if tp > 1 else 0.0  # after attention and MLP
    return inputs.efficiency.step_overhead_s + comm + roof


def prefill_s(inputs: Inputs, tp: int, sequences: int) -> float:
    """The prompts of ``sequences`` sequences through an engine on ``tp`` GPUs (s)."""
    flop = 2.0 * matmul_params(inputs.model) * sequences * inputs.workload.prompt_tokens
    return flop / (tp * inputs.hardware.peak_flop_per_s * inputs.efficiency.prefill_mfu)


def engine_rollout_s(inputs: Inputs, tp: int, sequences: int) -> float:
    """One engine generating ``sequences`` responses together (s): prefill, then one decode
    step per token of the longest response. Over those steps the batch holds on average
    sequences x mean / longest live sequences of prompt + mean / 2 tokens each."""
    w = inputs.workload
    steps = w.longest_response_tokens
    live = sequences * w.mean_response_tokens / steps
    context = w.prompt_tokens + w.mean_response_tokens / 2
    return prefill_s(inputs, tp, sequences) + steps * decode_step_s(inputs, tp, live, context)


def rollout_s(inputs: Inputs, replicas: int, tp: int) -> float:
    """The batch split over ``replicas`` engines of ``tp`` GPUs: the fullest one's time (s)."""
    return engine_rollout_s(inputs, tp, math.ceil(inputs.workload.sequences / replicas))


def train_s(inputs: Inputs, gpus: int) -> float:
    """The trainer's share of an update on ``gpus`` GPUs (s), scaling linearly with them:
    train_flop_factor x matmul weights x tokens / (gpus x peak x MFU)."""
    e = inputs.efficiency
    flop = e.train_flop_factor * matmul_params(inputs.model) * inputs.workload.trained_tokens
    return flop / (gpus * inputs.hardware.peak_flop_per_s * e.train_mfu)


def push_s(inputs: Inputs, replicas: int, placement: str) -> float:
    """A full bf16 push into every engine, one engine after another (s)."""
    e = inputs.efficiency
    rate = e.push_bytes_per_s if placement == "dedicated" else e.colocated_push_bytes_per_s
    return e.push_latency_s + replicas * weight_bytes(inputs.model) / rate


def update_time(inputs: Inputs, layout: Layout) -> Timing:
    """One update of ``layout`` (checked first)."""
    check_layout(inputs, layout)
    roll = rollout_s(inputs, layout.replicas, layout.engine_tp)
    train = train_s(inputs, layout.train_gpus)
    push = push_s(inputs, layout.replicas, layout.placement)
    switch = inputs.efficiency.switch_s if layout.placement == "colocated" else 0.0
    if layout.schedule == "sync":
        total = roll + train + push + switch
    elif layout.staged_push:
        total = max(roll, train + push)
    else:
        total = max(roll, train) + push
    return Timing(layout, roll, train, push, switch, total)


def layouts(inputs: Inputs, schedule: str, placement: str, replicas=None):
    """Every layout of a schedule and placement that can run; ``replicas``: only those
    engine counts (an iterable), else any."""
    gpus, seqs = inputs.gpus, inputs.workload.sequences
    floor = min_train_gpus(inputs)
    trains = [gpus] if placement == "colocated" else range(floor, gpus)
    for train in trains:
        if train < floor or seqs % train:  # data parallel: equal shares of the batch
            continue
        free = gpus if placement == "colocated" else gpus - train
        for tp in ENGINE_TPS:
            if not engine_tp_fits(inputs.model, tp):
                continue
            for n in range(1, free // tp + 1):
                if replicas is None or n in replicas:
                    yield Layout(schedule, placement, n, tp, train)


def best(inputs: Inputs, schedule: str, placement: str, replicas=None) -> Timing:
    """The fastest layout (``layouts``' arguments). Among those within 0.1 s of it: the one
    whose faster side has the most slack (the split most robust to a slow update), then
    the fewest GPUs, the fewest replicas, the lowest TP."""
    timings = [update_time(inputs, lay) for lay in layouts(inputs, schedule, placement,
                                                          replicas)]
    if not timings:
        raise ValueError(f"no {schedule} {placement} layout with replicas in {replicas} "
                         f"fits {inputs.gpus} GPUs")
    fastest = min(t.update_s for t in timings)
    near = [t for t in timings if t.update_s <= fastest + 0.1]
    return min(near, key=lambda t: (-max(t.trainer_wait, t.engine_wait),
                                    t.layout.generate_gpus + t.layout.train_gpus,
                                    t.layout.replicas, t.layout.engine_tp))


def calibrate_train_mfu(inputs: Inputs, gpus: int, seconds: float) -> Inputs:
    """``inputs`` with the trainer MFU at which ``train_s(inputs, gpus) == seconds``."""
    if seconds <= 0:
        raise ValueError(f"trainer time {seconds} s: must be > 0")
    unit = train_s(replace(inputs, efficiency=replace(inputs.efficiency, train_mfu=1.0)), gpus)
    return replace(inputs, efficiency=replace(inputs.efficiency, train_mfu=unit / seconds))


def calibrate_step_overhead(inputs: Inputs, layout: Layout, updates_per_h: float) -> Inputs:
    """``inputs`` with the decode-step overhead at which the sync ``layout`` makes
    ``updates_per_h``. Exact: a sync update grows by one overhead per decode step."""
    if layout.schedule != "sync":
        raise ValueError("calibrate on a sync layout (the async update is not linear in the "
                         "overhead)")
    zero = replace(inputs, efficiency=replace(inputs.efficiency, step_overhead_s=0.0))
    slack = 3600.0 / updates_per_h - update_time(zero, layout).update_s
    if slack < 0:
        raise ValueError(f"{updates_per_h} updates/h is faster than the model with no decode "
                         f"overhead ({update_time(zero, layout).updates_per_h:.2f}): lower the "
                         "assumed rates or response lengths")
    overhead = slack / inputs.workload.longest_response_tokens
    return replace(inputs, efficiency=replace(inputs.efficiency, step_overhead_s=overhead))


def calibrate_train_to_updates(inputs: Inputs, layout: Layout, updates_per_h: float) -> Inputs:
    """``inputs`` with the trainer MFU at which the sync ``layout`` makes ``updates_per_h``
    (the trainer takes whatever the rollout, push and switch leave)."""
    if layout.schedule != "sync":
        raise ValueError("calibrate on a sync layout")
    now = update_time(inputs, layout)
    seconds = 3600.0 / updates_per_h - (now.update_s - now.train_s)
    if seconds <= 0:
        raise ValueError(f"{updates_per_h} updates/h leaves the trainer {seconds:.2f} s: "
                         "the rollout alone is slower")
    return calibrate_train_mfu(inputs, layout.train_gpus, seconds)


# --- The paper's settings (docs/throughput-model.md gives every source) ------------------

# Table 1, 8 GPUs, 128 prompts per update: updates/h, dense Adam and LoGRA
PAPER_UPDATES_PER_H = {"1.5B": {"dense_adam": 54.28, "logra": 55.44},
                       "7B": {"dense_adam": 25.28, "logra": 25.73}}
SETTINGS = ("1.5B", "7B")  # the paper's settings modelled here (``memory.shapes.PAPER_SHAPES``)
# skzhang1/RL research/logra/configs/*.yaml: generation not colocated, 4 GPUs for it,
# vLLM TP 1 (the defaults file's), cluster of 8: four TP1 engines, trainer on the other 4
PAPER_LAYOUT = Layout("sync", "dedicated", replicas=4, engine_tp=1, train_gpus=4)
PAPER_LOGRA_TRAIN_S_1P5B = 11.31  # the paper's LoGRA s/update at 1.5B (the project's notes)


def dense_train_s_1p5b() -> float:
    """Dense Adam's trainer time at 1.5B (s): LoGRA's 11.31 s plus the difference of the
    two runs' update times, taking their rollouts and pushes as equal."""
    ups = PAPER_UPDATES_PER_H["1.5B"]
    return PAPER_LOGRA_TRAIN_S_1P5B + 3600.0 / ups["dense_adam"] - 3600.0 / ups["logra"]


def paper_inputs(setting: str, *, workload: Workload = Workload(),
                 hardware: Hardware = Hardware(), fit: str = "overhead") -> Inputs:
    """The paper's ``setting`` (1.5B or 7B), dense Adam, calibrated on the paper's layout.

    The trainer MFU comes from the 1.5B trainer time, the decode-step overhead from 1.5B's
    updates/h. What is fitted to ``setting``'s own updates/h:
    ``fit="overhead"``: the decode-step overhead (the MFU stays 1.5B's);
    ``fit="trainer"``: the trainer MFU (the overhead stays 1.5B's);
    ``fit="none"``: nothing (at 7B a prediction from 1.5B's calibration)."""
    if setting not in SETTINGS:
        raise ValueError(f"setting {setting!r}: choose {' or '.join(SETTINGS)}")
    if fit not in ("overhead", "trainer", "none"):
        raise ValueError(f"fit {fit!r}: choose overhead, trainer or none")
    small = calibrate_train_mfu(Inputs(shape_arch(PAPER_SHAPES["1.5B"]), workload, hardware,
                                       name=PAPER_SHAPES["1.5B"]),
                                PAPER_LAYOUT.train_gpus, dense_train_s_1p5b())
    small = calibrate_step_overhead(small, PAPER_LAYOUT,
                                    PAPER_UPDATES_PER_H["1.5B"]["dense_adam"])
    inputs = replace(small, model=shape_arch(PAPER_SHAPES[setting]), name=PAPER_SHAPES[setting])
    target = PAPER_UPDATES_PER_H[setting]["dense_adam"]
    if fit == "overhead":
        return calibrate_step_overhead(inputs, PAPER_LAYOUT, target)
    if fit == "trainer":
        return calibrate_train_to_updates(inputs, PAPER_LAYOUT, target)
    return inputs

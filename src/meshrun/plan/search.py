"""The layouts a user can write for a model on `nodes` boxes of the hardware profile, each
with its predicted memory per pipeline rank and speed, ranked: those that fit first, fastest
first (predictions within the speed model's resolution of each other count as equal, the one
with more memory to spare first). Legality is decided by the caller's `Legal` (the same
rules a run goes through, on the box the profile describes); a layout ruled out keeps its
reason for the "why not" of meshrun-plan.

The space: pp x dp_replicate x dp_shard x cp x tp (tp inside a node: its ranks are adjacent,
so it stays on the node's links iff it divides the devices per node; cp next to it, its
groups free to span nodes: the ring's sends hide behind attention), for an MoE model each ep
that divides its experts and dp_shard x cp (and with TP, its experts split over the TP ranks
or not: etp), each pipeline schedule with its stages per rank, sequence parallelism on and
off, activation checkpointing none / selective / op / full on every 2nd block / full, DDP's
bucket view, the micro-batch size. A key the user gave (`fixed`) keeps its value. Pruning:
for each layout and micro-batch size the checkpointing modes are tried cheapest first and
the first that fits is kept (recomputing more is never faster), a micro-batch size is not
tried where a smaller one had no variant that fits (a rank holds at least as much with a
larger one), and of a layout's variants only the fastest that fits (else the smallest) is
ranked.

Where none of a layout's variants fits, the memory levers are tried (plan/levers.py, each with the
checkpointing modes cheapest first, and only where its leanest variant fits): lighter
optimizer states, the blocks' activations in host memory, FSDP2's state in host memory, and
the two offloads together; of those that fit the fastest predicted is kept (a layout that
fits with none keeps its smallest variant without them). A lever the user gave keeps its
value; the loss is the run's own (train.loss=auto: the one without the whole logits, counted
in every row).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from meshrun.core.baseline import baseline_config
from meshrun.core.batch import local_batch_size
from meshrun.core.config import CLUSTER_LAUNCHER, ExperimentConfig
from meshrun.core.errors import ConfigError, fail
from meshrun.core.layout import Layout
from meshrun.models import model_shape
from meshrun.plan import predict
from meshrun.plan.candidate import Candidate, Legal, evaluate, host_flops
from meshrun.plan.levers import STRONGEST, lever_configs
from meshrun.plan.split import uneven_variant

# (schedule, stages_per_rank)
SCHEDULE_CHOICES = (("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2))
# (activation checkpointing, every n-th block), cheapest first: recompute nothing, the
# elementwise ops, those and every other matmul, every other block's forward, every block's
CHECKPOINTING = (("none", 1), ("selective", 1), ("op", 1), ("full", 2), ("full", 1))
MICRO_BATCH_SIZES = (1, 2, 4, 8)
# Context parallelism is searched where each CP rank keeps at least this many tokens of a
# sequence: a pruning of the search, as MICRO_BATCH_SIZES is (short sequences are not what
# fails to fit); a cp the user gives is always tried, with its parallel.cp_method.
MIN_CP_TOKENS = 4096
# Predictions closer than this are not told apart: the speed model's rows against published
# runs spread -11% to +11% (docs/architecture.md), its errors shared by similar layouts. Within a 2%
# band of speed the layout with the lower peak memory ranks first: it survives fragmentation,
# a longer sequence or a larger micro-batch that the faster-on-paper one would not.
SPEED_RESOLUTION = 0.02
# A dp_replicate x dp_shard split of data parallelism: the keys it sets.
DP_KEYS = ("parallel.dp_replicate", "parallel.dp_shard")
FLOAT8_KEY = "train.float8.enabled"


@dataclass(frozen=True)
class Box:
    """`nodes` of the profile's box, `per_node` ranks on each (rank r on device r % per_node)."""

    nodes: int
    per_node: int

    @property
    def world(self) -> int:
        return self.nodes * self.per_node


@dataclass
class Plan:
    """The ranked candidates, and why the layouts and variants that are not among them were
    ruled out: per rule (its message with the numbers left out), how many and the first
    message; `alternatives`, where the user's keys left nothing that fits, the best layouts
    without them."""

    ranked: list[Candidate]
    ruled_out: Counter[str] = field(default_factory=Counter)
    examples: dict[str, str] = field(default_factory=dict)
    alternatives: list[Candidate] = field(default_factory=list)
    alternative_to: list[str] = field(default_factory=list)  # the keys they leave out

    def rule_out(self, message: str) -> None:
        rule = re.sub(r"\d+", "N", message)
        self.ruled_out[rule] += 1
        self.examples.setdefault(rule, message)

    def reasons(self) -> list[tuple[str, int]]:
        """(first message, count) per rule, the most frequent first."""
        return [(self.examples[rule], n) for rule, n in self.ruled_out.most_common()]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _dp_splits(dp: int, tp: int, box: Box) -> list[tuple[int, int]]:
    """(replicate, shard): all-replicate (DDP), all-shard (FSDP), and HSDP sharding within a
    node and replicating across (dp_shard is the next dim out from tp), plus 2 x dp/2."""
    splits = {(dp, 1), (1, dp)}
    in_node = box.per_node // tp if box.per_node % tp == 0 else 1
    for shard in (in_node, dp // 2):
        if 1 < shard < dp and dp % shard == 0:
            splits.add((dp // shard, shard))
    return sorted(splits)


def _cp_degrees(cfg: ExperimentConfig, box: Box) -> list[int]:
    """The CP degrees worth a try: 1, and those whose ranks keep MIN_CP_TOKENS of a
    sequence cut into 2 x cp load-balanced chunks."""
    seq = cfg.train.seq_len
    return [
        d
        for d in _divisors(box.world)
        if d == 1 or (seq % (2 * d) == 0 and seq // d >= MIN_CP_TOKENS)
    ]


def _allowed(cfg: ExperimentConfig, fixed: frozenset[str], key: str, values: list) -> list:
    """`values`, or the one `cfg` gives where the user fixed `key`."""
    return [getattr(cfg.parallel, key.removeprefix("parallel."))] if key in fixed else values


def _ep_degrees(cfg: ExperimentConfig, shard: int) -> list[int]:
    """1, and for an MoE model the ep degrees that divide both its experts and the `shard`
    ranks (dp_shard x cp) they are drawn from."""
    experts = model_shape(cfg.model).experts
    return [d for d in _divisors(shard) if d == 1 or (experts and experts % d == 0)]


def _etp_degrees(cfg: ExperimentConfig, keys: dict) -> list[int]:
    """1, and under TP for an MoE tp (each expert's hidden width split over the TP ranks
    too; a model whose experts cannot be split so is refused by validation)."""
    tp = keys["tp"]
    return [1, tp] if tp > 1 and model_shape(cfg.model).experts else [1]


def layout_grid(cfg: ExperimentConfig, box: Box, fixed: frozenset[str]) -> Iterator[dict]:
    """Every layout's parallel keys; a key in `fixed` keeps `cfg`'s value."""
    for cp in _allowed(cfg, fixed, "parallel.cp", _cp_degrees(cfg, box)):
        if box.world % cp == 0:
            for keys in _without_cp(cfg, box, box.world // cp, fixed):
                shard = keys["dp_shard"] * cp
                for ep in _allowed(cfg, fixed, "parallel.ep", _ep_degrees(cfg, shard)):
                    for etp in _allowed(cfg, fixed, "parallel.etp", _etp_degrees(cfg, keys)):
                        yield {**keys, "cp": cp, "ep": ep, "etp": etp}


def _without_cp(
    cfg: ExperimentConfig, box: Box, world: int, fixed: frozenset[str]
) -> Iterator[dict]:
    """The layouts of the `world` ranks a CP degree leaves, over pp x dp x tp."""
    p, n_layers = cfg.parallel, model_shape(cfg.model).n_layers
    allowed = functools.partial(_allowed, cfg, fixed)
    for pp in allowed("parallel.pp", [d for d in _divisors(world) if d <= n_layers]):
        if world % pp:
            continue
        tps = [d for d in _divisors(world // pp) if box.per_node % d == 0]  # in a node
        for tp in allowed("parallel.tp", tps):
            if (world // pp) % tp:
                continue
            dp = world // (pp * tp)
            splits = _dp_splits(dp, tp, box)
            if fixed & set(DP_KEYS):
                splits = [(p.dp_replicate, p.dp_shard)] if p.dp_replicate * p.dp_shard == dp else []
            schedules = SCHEDULE_CHOICES if pp > 1 else (("1f1b", 1),)
            if "parallel.schedule" in fixed or "parallel.stages_per_rank" in fixed:
                schedules = ((p.schedule, p.stages_per_rank),)
            for rep, shard in splits:
                for schedule, stages_per_rank in schedules:
                    for sp in allowed(
                        "parallel.sequence_parallel", [False, True] if tp > 1 else [False]
                    ):
                        yield dict(
                            pp=pp,
                            tp=tp,
                            dp_replicate=rep,
                            dp_shard=shard,
                            schedule=schedule,
                            stages_per_rank=stages_per_rank,
                            sequence_parallel=sp,
                        )


def with_parallel(cfg: ExperimentConfig, box: Box, **keys: Any) -> ExperimentConfig:
    """A layout of the planner's, named as `parallel=auto` (what picks it; `single` for one
    rank): its display name is layout_name's, the overrides that run it layout_overrides'.
    Several nodes run through SLURM (launcher=local runs on one)."""
    parallel = dataclasses.replace(
        cfg.parallel, name="single" if box.world == 1 else "auto", data_parallel="auto", **keys
    )
    launcher = cfg.launcher
    if box.nodes > 1 and not launcher.spans_nodes:
        launcher = CLUSTER_LAUNCHER(nnodes=box.nodes)
    launcher = dataclasses.replace(
        launcher, nnodes=box.nodes, nproc_per_node=box.per_node, threads_per_rank=None
    )
    return dataclasses.replace(cfg, parallel=parallel, launcher=launcher)


def _micro_batches(cfg: ExperimentConfig, fixed: frozenset[str]) -> list[int]:
    if "train.micro_batch_size" in fixed:
        return [cfg.train.micro_batch_size]
    local = local_batch_size(cfg)
    return [m for m in MICRO_BATCH_SIZES if m <= local and local % m == 0] or [1]


def _variants(
    cfg: ExperimentConfig, fixed: frozenset[str]
) -> Iterator[tuple[tuple[str, int], bool]]:
    """((activation checkpointing, every n-th block), DDP bucket view), cheapest first."""
    p = cfg.parallel
    ckpts = list(CHECKPOINTING)
    if "parallel.activation_checkpointing" in fixed:
        ckpts = [c for c in ckpts if c[0] == p.activation_checkpointing]
    if "parallel.checkpoint_every" in fixed:
        every = p.checkpoint_every
        ckpts = [(mode, every) for mode in dict(ckpts) if mode != "none" or every == 1]
    ckpts = ckpts or [(p.activation_checkpointing, p.checkpoint_every)]
    ddp = Layout.of(cfg.parallel).uses_ddp
    views = [cfg.parallel.ddp.gradient_as_bucket_view]
    if ddp and "parallel.ddp.gradient_as_bucket_view" not in fixed:
        views = [False, True]
    for ckpt in ckpts:
        for view in views:
            yield ckpt, view


def _speed_key(c: Candidate) -> float:
    return c.speed.tokens_per_s if c.speed else 0.0


def best_variant(
    cfg: ExperimentConfig, legal: Legal, fixed: frozenset[str], plan: Plan
) -> Candidate | None:
    """A layout's fastest variant that fits, else its smallest; None if none is legal. The
    levers come in only where nothing fits without them (the module docstring)."""
    found = _best_of(cfg, legal, fixed, plan)
    if found is not None and found.fits:
        return found
    levers = list(lever_configs(cfg, fixed))
    strongest = [changed for lever, changed in levers if lever in STRONGEST]
    if strongest and not any(_leanest_fits(changed, legal, fixed) for changed in strongest):
        return found  # what saves the most does not fit it: no lever does
    for _, changed in levers:  # a lever a layout cannot take is no layout ruled out
        if not _leanest_fits(changed, legal, fixed):
            continue  # not even its smallest micro-batch, recomputing the most, fits
        with_lever = _best_of(changed, legal, fixed, Plan([]))
        if with_lever is not None and _better(with_lever, found):
            found = with_lever
    return found


def _leanest_fits(cfg: ExperimentConfig, legal: Legal, fixed: frozenset[str]) -> bool:
    """Whether `cfg`'s layout fits at its smallest micro-batch with its most recomputation."""
    train = dataclasses.replace(cfg.train, micro_batch_size=_micro_batches(cfg, fixed)[0])
    small = dataclasses.replace(cfg, train=train)
    found = _evaluated(small, list(_variants(small, fixed))[-1], legal)
    return not isinstance(found, str) and found.fits


def _evaluated(
    cfg: ExperimentConfig, variant: tuple[tuple[str, int], bool], legal: Legal
) -> Candidate | str:
    """`cfg` with one variant (checkpointing, every n-th block; DDP's bucket view), judged:
    its candidate, or the rule's reason it is not legal."""
    (ckpt, every), view = variant
    ddp = dataclasses.replace(cfg.parallel.ddp, gradient_as_bucket_view=view)
    parallel = dataclasses.replace(
        cfg.parallel, activation_checkpointing=ckpt, checkpoint_every=every, ddp=ddp
    )
    resolved = legal_or_reason(dataclasses.replace(cfg, parallel=parallel), legal)
    return resolved if isinstance(resolved, str) else evaluate(resolved)


def _better(c: Candidate, than: Candidate | None) -> bool:
    """Fits where the other does not; faster where both fit; smaller where neither does."""
    if than is None:
        return True
    if c.fits != than.fits:
        return c.fits
    return _speed_key(c) > _speed_key(than) if c.fits else c.peak < than.peak


def _best_of(
    cfg: ExperimentConfig, legal: Legal, fixed: frozenset[str], plan: Plan
) -> Candidate | None:
    """The fastest variant of `cfg`'s layout that fits (micro-batch, checkpointing, DDP's
    view), else its smallest; None if none is legal."""
    fitting: Candidate | None = None
    smallest: Candidate | None = None
    for micro in _micro_batches(cfg, fixed):
        train = dataclasses.replace(cfg.train, micro_batch_size=micro)
        evaluated = fits = False
        sized = dataclasses.replace(cfg, train=train)
        for variant in _variants(sized, fixed):
            c = _evaluated(sized, variant, legal)
            if isinstance(c, str):
                plan.rule_out(c)
                continue
            evaluated = True
            if c.fits:
                fits = True
                if fitting is None or _speed_key(c) > _speed_key(fitting):
                    fitting = c
                break  # more recomputation or the other view: no faster
            if smallest is None or c.peak < smallest.peak:
                smallest = c
        if evaluated and not fits:
            break  # a larger micro-batch holds at least as much
    return fitting or smallest


def legal_or_reason(cfg: ExperimentConfig, legal: Legal) -> ExperimentConfig | str:
    try:
        return legal(cfg)
    except ConfigError as err:
        return f"{err.key}={err.value}: {err.problem}"


def search(
    cfg: ExperimentConfig, box: Box, legal: Legal, fixed: frozenset[str] = frozenset()
) -> Plan:
    """Ranked candidates; pipelines on mixed boxes get an uneven split as well."""
    plan = Plan([])
    for keys in layout_grid(cfg, box, fixed):
        if box.per_node % keys["tp"]:  # only where the user asked for this tp
            plan.rule_out(_tp_across_nodes(keys["tp"], box))
            continue
        for precision in float8_variants(cfg, fixed):
            best = best_variant(with_parallel(precision, box, **keys), legal, fixed, plan)
            if best is None:
                continue
            plan.ranked.append(best)
            uneven = uneven_variant(best, legal)
            if uneven is not None:
                plan.ranked.append(uneven)
    if not plan.ranked and not plan.ruled_out:
        plan.rule_out(_no_layout_reason(box, fixed))
    add_speedups(plan.ranked, legal)
    add_float8_gains(plan.ranked)
    plan.ranked.sort(key=ranking(plan.ranked))
    return plan


def float8_unplanned(cfg: ExperimentConfig) -> str | None:
    """Why the plan has no float8 rows where the user did not ask for them: a CPU (float8's
    casts cost more than its matmuls save there), or a device without float8 tensor cores;
    None where it has them."""
    if cfg.hardware.device_type != "cuda":
        return "a CPU's float8 matmuls are no faster and its casts cost more"
    lacking = [s.name for s in cfg.hardware.devices if "fp8" not in s.peak_tflops]
    if lacking:
        return (
            f"{', '.join(lacking)} has no float8 tensor cores (float8 matmuls need compute "
            "capability 8.9: Ada, Hopper, Blackwell; its profile lists no fp8 peak)"
        )
    return None


def float8_variants(cfg: ExperimentConfig, fixed: frozenset[str]) -> list[ExperimentConfig]:
    """`cfg` in high precision and, where the devices have float8 tensor cores and the user
    fixed no train.float8.enabled, with train.float8 (and train.compile, unless fixed)."""
    if FLOAT8_KEY in fixed or float8_unplanned(cfg):
        return [cfg]
    off = dataclasses.replace(cfg.train.float8, enabled=False)
    on = dataclasses.replace(cfg.train.float8, enabled=True)
    compiled = cfg.train.compile if "train.compile" in fixed else True
    return [
        dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, float8=off)),
        dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, float8=on, compile=compiled)),
    ]


def add_float8_gains(candidates: list[Candidate]) -> None:
    """Each float8 row's predicted tokens/s over the same layout's high-precision row's."""
    high = {_layout_key(c): c for c in candidates if not c.cfg.train.float8.enabled}
    for c in candidates:
        high_precision = high.get(_layout_key(c))
        if c.cfg.train.float8.enabled and high_precision and high_precision.speed and c.speed:
            c.float8_gain = c.speed.tokens_per_s / high_precision.speed.tokens_per_s


def _layout_key(c: Candidate) -> tuple:
    """A layout apart from its precision and its checkpointing and micro-batch (each
    precision's fastest variant that fits)."""
    p = c.cfg.parallel
    degrees = tuple(sorted(Layout.of(p).degrees().items()))
    return (degrees, p.ep, p.etp, p.schedule, p.stages_per_rank, p.sequence_parallel, p.cp_method)


def _no_layout_reason(box: Box, fixed: frozenset[str]) -> str:
    return f"the given keys ({', '.join(sorted(fixed))}) leave no layout of {box.world} ranks"


def _tp_across_nodes(tp: int, box: Box) -> str:
    where = (
        f"spans {math.ceil(tp / box.per_node)} nodes"
        if tp > box.per_node
        else "groups straddle nodes"
    )
    return f"parallel.tp={tp}: {where} of {box.per_node} devices (TP stays on a node's links)"


def with_layout(cfg: ExperimentConfig, candidate: Candidate) -> ExperimentConfig:
    """`cfg` with the candidate's layout and micro-batch size."""
    chosen = candidate.cfg
    return dataclasses.replace(cfg, parallel=chosen.parallel, train=chosen.train)


def fitting_layouts(cfg: ExperimentConfig, world: int, legal: Legal) -> list[Candidate]:
    """`parallel=auto`'s choice: the plan's rows that are predicted to fit, in its order (the
    first is the layout a run takes, the first K those plan.trials measures); ConfigError
    where none does."""
    box = Box(cfg.launcher.nnodes, world // cfg.launcher.nnodes)
    # the run's own train.float8 stands: parallel=auto picks a layout, not a precision
    ranked = [c for c in search(cfg, box, legal, frozenset({FLOAT8_KEY})).ranked if c.fits]
    if not ranked:
        fail(
            "parallel",
            "auto",
            f"no layout of {world} ranks is predicted to fit "
            "(meshrun-plan lists them with their memory)",
            "more devices, a smaller model or a shorter train.seq_len",
        )
    return ranked


def why(ranked: list[Candidate]) -> str:
    """The chosen layout (the first), its prediction, and the runner-up it beat."""
    first = ranked[0]
    speed = f"{first.speed.tokens_per_s:,.0f} tokens/s" if first.speed else "speed unknown"
    peak = f"peak {first.peak / 2**30:.2f} of {min(first.capacity) / 2**30:.1f} GiB"
    text = (
        f"{first.label} ({first.overrides()}): predicted {speed}, {peak} per rank; the "
        f"top row of the plan of the {len(ranked)} layouts that fit"
    )
    fastest = max(ranked, key=_speed_key)
    if fastest is not first and first.speed and fastest.speed:
        behind = 1 - first.speed.tokens_per_s / fastest.speed.tokens_per_s
        text += (
            f", {behind:.1%} behind the fastest prediction ({fastest.label}, peak "
            f"{fastest.peak / 2**30:.2f} GiB): closer than the speed model tells apart "
            f"({SPEED_RESOLUTION:.0%}), so the one with more memory to spare"
        )
    elif len(ranked) > 1 and ranked[1].speed and first.speed:
        lead = first.speed.tokens_per_s / ranked[1].speed.tokens_per_s
        text += f", the fastest, {lead:.2f}x the next ({ranked[1].label})"
    return text + "; meshrun-plan lists them all"


def ranking(candidates: list[Candidate]) -> Callable[[Candidate], tuple]:
    """The sort key: those that fit first; by 2% bands of speed below the fastest that fits
    (SPEED_RESOLUTION), then by peak memory, then by speed; those that do not fit by speed."""
    top = max((_speed_key(c) for c in candidates if c.fits), default=0.0)
    width = -math.log1p(-SPEED_RESOLUTION)

    def key(c: Candidate) -> tuple:
        speed = _speed_key(c)
        if not (c.fits and speed > 0 and top > 0):
            return (not c.fits, math.inf, -speed, c.peak)
        return (False, math.floor(math.log(top / speed) / width), c.peak, -speed)

    return key


def add_speedups(candidates: list[Candidate], legal: Legal) -> None:
    """Against the single-device baseline of each (weak scaling: one device's share of the
    batch)."""
    singles: dict[str, float | None] = {}
    for c in candidates:
        if c.speed is None:
            continue
        baseline = baseline_config(c.cfg)
        key = repr((baseline.train, baseline.parallel))
        if key not in singles:
            resolved = legal_or_reason(baseline, legal)
            single = (
                None if isinstance(resolved, str) else predict.speed(resolved, host_flops(resolved))
            )
            singles[key] = single.tokens_per_s if single else None
        if singles[key]:
            c.speedup = c.speed.tokens_per_s / singles[key]

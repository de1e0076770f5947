"""The pure bookkeeping core: immutable records and the pure functions that advance them.

Imports only the standard library and attrs, so it can be embedded in any loop and property-tested
without torch.
"""

from trainkit.bookkeeping._records import as_verdict, is_bool_like, is_finite_real, is_int, is_real
from trainkit.bookkeeping.best import BestState, best_metric_key, retune_min_delta, save_if_best
from trainkit.bookkeeping.guard import (
    GUARD_MODES,
    GuardState,
    RollbackStreak,
    is_finite_value,
    replay_guard,
    rollback_candidate,
    step_guard,
    step_rollbacks,
    unblamable_steps,
)
from trainkit.bookkeeping.patience import PatienceState, retune_patience, step_patience
from trainkit.bookkeeping.position import EpochPosition, next_step_checkpoint, position_mismatch, step_checkpoint_due
from trainkit.bookkeeping.registry import (
    RESERVED_NAMES,
    CkptRegistry,
    apply_payload,
    collect_payload,
    register_items,
)
from trainkit.bookkeeping.reshard import (
    ResumeDecision,
    decide_resume,
    distributed_order,
    pooled_mean_share,
    resumable_world_sizes,
    world_change_refusal,
)
from trainkit.bookkeeping.resume import Resumed, reconcile
from trainkit.bookkeeping.retention import (
    Checkpoint,
    KeepAny,
    KeepBest,
    KeepEvery,
    KeepEverySeconds,
    KeepLatest,
    Policy,
    keep_reasons,
    parse_keep,
    retain,
    unranked,
)
from trainkit.bookkeeping.schedule import (
    STOP_EARLY,
    STOP_MAX_EPOCHS,
    STOP_MAX_STEPS,
    LoopState,
    end_epoch,
    planned_steps,
    resume_loop,
    should_validate,
    validates_at_epoch_end,
)
from trainkit.bookkeeping.throughput import PEAK_FLOPS, PERF_KEYS, ThroughputMark, mfu, peak_flops, throughput_rates

__all__ = [
    "GUARD_MODES",
    "GuardState",
    "step_guard",
    "replay_guard",
    "is_finite_value",
    "rollback_candidate",
    "unblamable_steps",
    "RollbackStreak",
    "step_rollbacks",
    "BestState",
    "save_if_best",
    "best_metric_key",
    "retune_min_delta",
    "PatienceState",
    "step_patience",
    "retune_patience",
    "as_verdict",
    "is_bool_like",
    "is_int",
    "is_real",
    "is_finite_real",
    "CkptRegistry",
    "RESERVED_NAMES",
    "register_items",
    "collect_payload",
    "apply_payload",
    "LoopState",
    "end_epoch",
    "resume_loop",
    "should_validate",
    "Resumed",
    "reconcile",
    "STOP_EARLY",
    "STOP_MAX_EPOCHS",
    "STOP_MAX_STEPS",
    "planned_steps",
    "validates_at_epoch_end",
    "EpochPosition",
    "step_checkpoint_due",
    "next_step_checkpoint",
    "position_mismatch",
    "ResumeDecision",
    "decide_resume",
    "distributed_order",
    "pooled_mean_share",
    "resumable_world_sizes",
    "world_change_refusal",
    "ThroughputMark",
    "throughput_rates",
    "PERF_KEYS",
    "PEAK_FLOPS",
    "peak_flops",
    "mfu",
    "Checkpoint",
    "KeepLatest",
    "KeepEvery",
    "KeepEverySeconds",
    "KeepBest",
    "KeepAny",
    "Policy",
    "retain",
    "unranked",
    "keep_reasons",
    "parse_keep",
]

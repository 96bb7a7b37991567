"""The bundled CED engine (ENGINE.md): a CED/CSA2 model with FP4 global KV and SWA rings.

Public API: `CEDConfig` and its presets, `CEDEngine`, `RowPlan` and the row planners, and the
`GlobalSlice` payload of exported global state.
"""

from .config import CEDConfig, LayerMode, get_preset, mini, tiny, v41
from .engine import CEDEngine
from .plan import REPLAY_MODES, RowPlan, exact_replay_rows, prefill_plan, replay_rows, staircase
from .state import SequenceState
from .transfer import GlobalSlice

__all__ = [
    "CEDConfig", "LayerMode", "get_preset", "mini", "tiny", "v41", "CEDEngine", "REPLAY_MODES", "RowPlan",
    "exact_replay_rows", "prefill_plan", "replay_rows", "staircase", "SequenceState", "GlobalSlice",
]

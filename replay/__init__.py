"""How rebuildable state comes back: replay planning (exact / bounded / off) and execution."""

from replay.executor import ReplayReport, execute_replay
from replay.planner import ReplayPlan, plan_replay

__all__ = ["ReplayPlan", "plan_replay", "ReplayReport", "execute_replay"]

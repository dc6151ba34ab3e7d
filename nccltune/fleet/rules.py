"""What `fleet decide` decides by: the objective a class is tuned for (the workload profile that
weighs each collective and size), the gain a choice must show and the regression it may not, as
the config gives them (`decide.rules_from`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..sweep import profiles


@dataclass(frozen=True)
class Rules:
    profile: str
    min_gain_pct: float
    max_regression_pct: float
    # sweep.profiles as the sweep reads them: name -> collective -> size -> weight (config.profile_collectives)
    custom_profiles: profiles.Custom = field(default_factory=dict)

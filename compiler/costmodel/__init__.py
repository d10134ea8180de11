"""Cost models: how long a token slice takes on a pipeline stage, and how many bytes it moves.

`CostModel` is the base class the optimiser, the simulator and compile use (`base.py`: five
required methods, defaults for the rest); `UnitCosts` is the textbook model (forward 1,
backward 2); `AnalyticCostModel` prices a GPT from its shapes and a `DeviceSpec`;
`GraphCostModel` the traced graph's own ops on a device; `ProfiledCostModel` a measured profile
(`tpc profile`). `load_cost_model` (resolve.py) builds one from the command-line options.
"""

from tpc.compiler.costmodel.analytic import AnalyticCostModel, ModelShapes, even_layers
from tpc.compiler.costmodel.base import CostModel, slot_times
from tpc.compiler.costmodel.unit import UnitCosts
from tpc.compiler.costmodel.devices import PRESETS, DeviceSpec, load_device_spec
from tpc.compiler.costmodel.fit import CurveFit, fit_curve
from tpc.compiler.costmodel.resolve import load_cost_model
from tpc.compiler.costmodel.profiled import ProfiledCostModel
from tpc.compiler.costmodel.store import Profile, UnitProfile, load_profile, save_profile

__all__ = [
    "AnalyticCostModel",
    "CostModel",
    "CurveFit",
    "DeviceSpec",
    "ModelShapes",
    "PRESETS",
    "Profile",
    "ProfiledCostModel",
    "UnitCosts",
    "UnitProfile",
    "even_layers",
    "fit_curve",
    "load_cost_model",
    "load_device_spec",
    "load_profile",
    "save_profile",
    "slot_times",
]

"""Cost models: how long a token slice takes on a pipeline stage, and how many bytes it moves.

`CostModel` is the protocol the optimiser, the simulator and compile use; `AnalyticCostModel`
prices a model from its shapes and a `DeviceSpec`; `ProfiledCostModel` from a measured profile
(`tpc profile`). `load_cost_model` builds either from the command-line options.
"""

from tpc.compiler.costmodel.analytic import AnalyticCostModel, ModelShapes, even_layers
from tpc.compiler.costmodel.base import CostModel, slice_times_of, slot_times
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
    "UnitProfile",
    "even_layers",
    "fit_curve",
    "load_cost_model",
    "load_device_spec",
    "load_profile",
    "save_profile",
    "slice_times_of",
    "slot_times",
]

"""Physical plants ẋ = f(t, x, u) that flow in wall time beside the token clock, and a CBF safety filter."""

from hybridlm.plant.builtins import PLANTS, make_plant, room, tank, tank_level
from hybridlm.plant.cbf import CBF, Barrier, Filtered
from hybridlm.plant.clock import ManualClock, WallClock
from hybridlm.plant.system import Actuator, Plant, PlantTool, Sensor

__all__ = ["CBF", "PLANTS", "Actuator", "Barrier", "Filtered", "ManualClock", "Plant", "PlantTool", "Sensor",
           "WallClock", "make_plant", "room", "tank", "tank_level"]

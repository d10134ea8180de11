"""A stage's programs (forward, backward, and the backward's input and weight halves), derived
from its joint graph (`joint.py`) and optionally compiled (`compiled.py`)."""

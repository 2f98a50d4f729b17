"""How a model is spread over ranks: the degrees (dims.py), the wrapping in its one order
(wrap.py), the starting weights each rank fills in (weights.py), and precision (precision.py)."""

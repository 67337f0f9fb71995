"""`moeserve plan`: size a deployment before renting it.

A cost model of one step of this runtime (`cost.py`, over `hardware.py`'s GPU table and
`shapes.py`'s model shapes), a serving model on top of it (`serving.py`: continuous batching,
chunked prefill, prefill/decode split, MTP), a search over layouts (`search.py`), calibration
from measured results (`calibrate.py`), and the command (`cli.py`, `report.py`).
"""

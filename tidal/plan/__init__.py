"""`tidal plan`: a discrete-event simulator of tidal's training loop and a planner over placements
(docs/plan.md). It imports nothing of tidal's runtime: the loop is modelled (`loop.py`, on SimPy), the
costs come from a roofline over an accelerator table (`cost.py`, `hardware.py`, `sync_model.py`) whose
efficiencies are stated or calibrated on a run (`calibrate.py`). SimPy comes with the `plan` extra.
"""

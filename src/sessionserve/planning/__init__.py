"""The tools built on the simulator: replaying traces on it (`driver`, `runs`), fleets behind a router
(`fleet`), the capacity planner (`planner`), calibrating a profile on the real engine (`calibrate`) and
comparing the simulator with the real engine (`fidelity`). The mechanism they drive (virtual clock, cost
model, virtual mover, `SimEngine`) is `sessionserve.sim`, which imports none of this."""

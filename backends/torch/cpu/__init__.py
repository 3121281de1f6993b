"""The torch backend's CPU kernels and the Python side of each: shapes, checks and the call.

The kernels are C/C++ in ``csrc/`` (one file per op family, shared headers, one op-registration file), built per CPU
level by CMake at install (``build.py``) and loaded once per process by ``library.py``, which picks the best level
this CPU runs. What runs where is the CPU execution plan (platforms/cpu_plan.py, built for a model by ``plan.py``):
the modules here read it, never an environment switch.
"""

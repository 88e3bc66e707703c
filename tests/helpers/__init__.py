"""Shared test code (importable as ``helpers``; pytest puts ``tests/`` on the path, see pyproject.toml).

``values``: sample ComfyUI-shaped values; ``cachefiles``: reading and damaging a cache's files as an attacker
would; ``sources``: source folders and a recording toy encoder for the builder; ``installs``: the ComfyUI
installations the node tests run against and child-process environments. The scripts here
(``build_worker.py``, ``comfy_scenario.py``, ``frontend_check.py``) run in child processes.
"""

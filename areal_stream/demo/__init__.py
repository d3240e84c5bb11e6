"""The main job: a simulated asynchronous RLVR run on local defaults.

``python -m areal_stream.demo`` starts the real controller, several rollout worker
processes (each running dozens of concurrent async workflows against a fake generation
engine) and 2 gloo training ranks running a fake PPO update, then prints where the logs
are. See ``python -m areal_stream.demo --help``.
"""

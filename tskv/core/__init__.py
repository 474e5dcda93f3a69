"""The core: tskv's values and rules, with no I/O.

Everything here takes values (and a clock, where time matters) and returns values or actions;
nothing here imports trio or zmq (`tests/test_layers.py` checks), so every decision is tested
without sockets. The shells (`tskv.shells`) carry out what it decides.
"""

"""The model: the forward pass and the weights it computes with.

``forward`` (the Llama-family forward over paged KV), ``fused_decode`` (the decode step through
the fused CPU ops), ``prefill`` (many-row steps in the quantised modes), ``modes`` (the ``weights``
and ``head_weights`` options), ``self_check`` (a quantised mode proves itself on the CPU it runs
on) and ``cpu_threads`` (how many threads a
step computes with). Loading a model's files and the quantised weight formats are ``chatkv.weights``;
the runner that batches a step for the forward is ``chatkv.engine.model_runner``. Import the module you need:
this package imports nothing itself.
"""

"""OpenAI's Responses API on ``chatkv serve``: ``routes`` (``POST /v1/responses``, ``GET`` and
``DELETE``), ``request`` (its request bodies and ids), ``shapes`` (response objects and stream
events) and ``tools`` (structured output and function tools). Import the module you need: this
package imports nothing itself.
"""

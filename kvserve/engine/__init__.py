"""The engine layer: everything that turns a request into tokens around the core and runtime.

- ``config``: ``EngineConfig``, the frozen, validated engine options (torch-free).
- ``llm_engine``: ``LLMEngine`` (add_request / step / abort): scheduler + runner + detokenizer.
- ``startup``: start-up phases (model load, kernel choice, memory budget, KV pool).
- ``memory_budget``: how the memory budget is split into weights, activations, headroom, KV.
- ``llm``: ``LLM``, the offline front door (generate / chat / stats).
- ``async_engine``: the engine loop behind the server, one thread, request queues.
- ``metrics``: latency histograms (TTFT, TPOT, ITL, e2e) named as the server exports them.
- ``step_guard`` / ``fault_injection``: a failing step fails its requests, never the engine.

NOTE: this ``__init__`` imports nothing, so ``kvserve.engine.config`` stays torch-free.
"""

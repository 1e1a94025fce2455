"""Static activation planning: trace one step, take every tensor's lifetime, pack one arena.

Seed ("Activation and Workspace Memory"): knowing every tensor's lifetime, assign offsets in
a pre-allocated arena so that tensors whose lifetimes do not overlap reuse the same bytes.

1. **Trace.** ``trace_step`` runs one runner step (input batch -> forward -> logits ->
   sampler) under a ``TorchDispatchMode`` that records every aten op's new output buffers
   with their size, the op that produced them, the last op that read them (any view or
   in-place alias counts as a use of its base) and the op at which eager PyTorch freed them.
   The forward runs on fake tensors (``FakeTensorMode``), so planning a 2048-token step of a
   model allocates nothing; the fake tensors keep the real device, so composite ops decompose
   exactly as in eager (e.g. CPU SDPA -> the flash kernel, not the math path).
   NOTE: the paged-attention code is plain eager PyTorch with Python control flow over the
   step's sequences, which torch.fx cannot trace; a dispatch mode sees the ops it issues.
   Op-internal workspace (a kernel's scratch) is invisible to it, so the recorder adds what
   ``kernel_scratch.py`` models (the per-thread buffers of CPU flash attention, of the
   native decode kernel and of the AMX prefill kernel) as a buffer live at that op only, and
   collects the step's GEMM shapes, whose library buffers the engine measures at start-up
   (``kernel_scratch.measure_gemm_scratch``). The native kernels are custom ops with fake
   kernels (``kvserve.runtime.native``), so the trace sees them as one op each.
2. **Pack.** ``pack_intervals``: greedy by size (largest first) with best-fit offsets, the
   "greedy by size" strategy of TFLite's arena planner (Pisarchyk & Lee, 2020).
3. **Report** (``ArenaPlan``): planned peak (arena size), naive sum (one buffer per tensor,
   no reuse) and the lower bound (most bytes live at one op, which no packing can beat).

``worst_case_steps`` builds the largest steps the scheduler can issue under its limits and
``plan_activations`` returns the plan of the most demanding one.

Modules: ``arena.py`` packs the lifetimes (``pack_intervals``, ``ArenaPlan``), ``recorder.py``
records them (``LifetimeRecorder``), ``planner.py`` builds, traces and plans the worst-case
steps (``worst_case_steps``, ``trace_step``, ``plan_activations``, ``ActivationPlan``).
"""

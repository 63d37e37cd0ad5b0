"""The compiled piecewise executor (seed 003's behaviour): spillway.compile(model,
weights="offload").

    compiled = spillway.compile(model, weights="offload", gpu_budget="50%")
    with torch.inference_mode():
        out = compiled(x)                      # call 1 warms up, call 2 is profiled
    compiled.spillway_weights.forecast()       # the resident-set plan and its forecast
    compiled.spillway_weights.detach()         # weights on the device for good

Note [Piecewise executor]
~~~~~~~~~~~~~~~~~~~~~~~~~
The weights are held as offload_weights() holds them (Note [Layer-wise weights]
in layerwise.py): one pinned host slab per group (a block, or a block's child
with granularity='children'), streamed through a few device buffers along the
observed order as a ring, the groups the resident-set scheduler chooses kept on
the device for good. What differs is who moves them. Instead of module hooks,
a torch.compile backend receives each graph Dynamo captures (the parameters are
graph inputs: Dynamo lifts them, torch >= 2.5's default), and:

1. cuts it into pieces, in graph order: a piece ends where the next node
   belongs to another group (by the module stack Dynamo records), and the code
   outside the blocks (embeddings, the head) is a piece with no group. Nodes of
   a block outside its children's groups (a residual add) stay in the piece
   before them;
2. compiles each piece with the inner backend ("inductor", "eager", or any
   registered name) on its first run, with the real inputs, once per input
   shapes: a piece never recompiles because of the offload;
3. runs the pieces itself: before a piece, for each group whose weights it
   reads, the compute stream waits for that group's copy (and the next groups'
   copies start); the piece gets the weights' device views in place of the
   parameters, which hold placeholders of their shape with no storage (what
   Dynamo traced and guards on); after the piece the group's buffer goes back
   to the caching allocator in stream order, and values the rest of the graph
   no longer reads are dropped.

A call of the module spillway.compile returns is a call of the handle (its
hooks, which run outside Dynamo, bracket it): the first warms up, the second is
profiled (each group's compute between its wait and its end, and the compute
between groups, from CUDA events), and the scheduler plans again from those
times (forecast()). Graph breaks change nothing there: the graphs of one call
run inside that call, the order observed over all of them is the ring the next
call prefetches along, and a group read by two graphs (a break inside a block)
is brought twice, its copy prefetched for the second like any other. The code
Dynamo runs between two graphs sees the parameters' placeholders (NaN): a
break inside a block that reads a weight eagerly, rather than through a graph,
computes on NaN, never on a stale value. A group's module that Dynamo runs
eagerly within a call (its frame past the recompile limit, cache_size_limit)
runs as offload_weights() runs it: a hook brings its weights and binds their
views to its parameters until it ends, and a piece that reads them meanwhile
finds them live. Outside a call of the compiled model a block is refused.

Exactness: a piece computes what the same piece computes with the weights
resident, so outputs are bit-equal to the model compiled the same way with
every weight on the device (gpu_budget=1.0). Against plain torch.compile of
the whole graph, fp32 results are equal; in 16-bit types Inductor may fuse
across a piece boundary (a residual add into the next norm) and keep the value
in fp32 where the piece stores it rounded, so the last bits may differ.

Training: with autograd recording, each piece gets the parameters themselves,
which hold their group's device views for the piece (placeholders again after
it), so the piece's compiled backward (AOTAutograd's, with Inductor) produces
their gradients, accumulated into .grad. What the pieces save of the weights
is packed as references by the handle's saved_tensors_hooks, and backward
brings the groups back in reverse order one ahead, as for offload_weights()
(Note [Weights in backward] in _training.py); a resident group's references
resolve to its resident buffer. The optimizer steps inside mutate_weights().
"""
from __future__ import annotations

import operator

import torch
from torch import fx, nn

from spillway._device import shown as _shown


class _Piece:
    """One cut of the graph: its submodule, the groups whose weights it reads, and where
    each of its inputs comes from."""

    def __init__(self, name: str, module: fx.GraphModule, node: fx.Node):
        self.name, self.module, self.node = name, module, node
        self.groups: list[int] = []
        self.last: list[int] = []  # the groups no later piece of the graph reads
        # Per input: (the cut graph's node, group, slot); group None: a value.
        self.inputs: list[tuple] = []
        self.compiled: dict[tuple, object] = {}  # input signature -> compiled callable


class PiecewiseExecutor:
    """One Dynamo graph, cut into pieces and run with the weights streamed (Note
    [Piecewise executor])."""

    def __init__(self, handle, gm: fx.GraphModule, example_inputs, backend):
        self.handle, self.backend = handle, backend
        self.placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        if len(self.placeholders) != len(example_inputs):
            raise RuntimeError(f"[weights] compiled: the graph has {len(self.placeholders)} "
                               f"inputs and Dynamo gave {len(example_inputs)} examples")
        where = handle._where_of_params()
        self.weights: dict[int, tuple[int, int]] = {}  # input position -> (group, slot)
        for i, value in enumerate(example_inputs):
            if id(value) in where:
                self.weights[i] = where[id(value)]
        for node in gm.graph.nodes:
            if node.op == "get_attr":
                target = _attr(gm, node.target)
                if isinstance(target, torch.Tensor) and id(target) in where:
                    raise RuntimeError(
                        f"[weights] compiled: Dynamo captured {node.target} as a constant of "
                        f"the graph, not as an input, so the executor cannot hand it its "
                        f"device copy; set torch._dynamo.config.inline_inbuilt_nn_modules = "
                        f"True (the default from torch 2.5)")
        self.expected = {i: example_inputs[i] for i in self.weights}
        self._cut(gm)

    # ---- cutting ----------------------------------------------------------------------

    def _cut(self, gm: fx.GraphModule) -> None:
        from torch.fx.passes.split_module import split_module
        h = self.handle
        group_paths = {b.path: b.index for b in h._blocks if b.slots}
        block_paths = set(h.blocks)
        weight_group = {self.placeholders[i]: g for i, (g, _) in self.weights.items()}

        piece, current, count = {}, None, 0
        for node in gm.graph.nodes:
            if node.op in ("placeholder", "output"):
                continue
            owner = _owner(node, group_paths, block_paths)
            if owner is None:  # no module stack: the groups whose weights it reads
                read = [weight_group[a] for a in node.all_input_nodes if a in weight_group]
                owner = read[0] if read else "inside"
            if owner == "inside":  # in a block, outside its groups: stays with what precedes
                owner = current if current is not None else "outside"
            if owner != current or not piece:
                current = owner
                count += 1
            piece[node] = count - 1
        split = split_module(gm, None, lambda node: piece[node], keep_original_order=True)
        self.nodes = list(split.graph.nodes)
        split_inputs = [n for n in self.nodes if n.op == "placeholder"]
        if len(split_inputs) != len(self.placeholders):
            raise RuntimeError(f"[weights] compiled: cutting the graph changed its inputs "
                               f"({len(self.placeholders)} -> {len(split_inputs)})")
        self.positions = {n: i for i, n in enumerate(split_inputs)}
        self.pieces: dict[str, _Piece] = {}
        for node in self.nodes:
            if node.op == "call_module":
                module = getattr(split, node.target)
                _canonical_names(module)
                self.pieces[node.name] = _Piece(node.name, module, node)
        self._bind_weights()
        self.uses = {n: len(n.users) for n in self.nodes}

    def _bind_weights(self) -> None:
        """Each piece's inputs: (the cut graph's node, group, slot), group None for a value
        the environment holds; and the groups each piece reads."""
        for p in self.pieces.values():
            p.inputs, p.groups = [], []
            for arg in p.node.args:
                position = self.positions.get(arg)
                group, slot = self.weights.get(position, (None, None))
                p.inputs.append((arg, group, slot))
                if group is not None and group not in p.groups:
                    p.groups.append(group)
        # Per piece: the groups whose last piece in this graph it is.
        last = {g: name for name, p in self.pieces.items() for g in p.groups}
        for name, p in self.pieces.items():
            p.last = [g for g in p.groups if last[g] == name]

    # ---- running ------------------------------------------------------------------------

    def __call__(self, *args):
        h = self.handle
        if h._detached or h._mutating or not h._blocks:
            # The parameters hold their values: the pieces run on what Dynamo passes.
            return self._run(args, streaming=False)
        if self._stale(args):
            self._rebind(args)
        training = torch.is_grad_enabled() and any(
            isinstance(a, torch.Tensor) and a.requires_grad for a in args)
        h._call_starts()
        try:
            return self._run(args, streaming=True, training=training)
        finally:
            h._call_ends()

    def _stale(self, args) -> bool:
        return any(args[i] is not t for i, t in self.expected.items())

    def _rebind(self, args) -> None:
        """The parameters were replaced (mutate_weights() with new tensors): the inputs'
        groups and slots are looked up again."""
        where = self.handle._where_of_params()
        self.weights = {i: where[id(a)] for i, a in enumerate(args) if id(a) in where}
        self.expected = {i: args[i] for i in self.weights}
        self._bind_weights()

    def _run(self, args, streaming: bool, training: bool = False):
        h = self.handle
        env: dict[fx.Node, object] = {}
        left = dict(self.uses)
        for node in self.nodes:
            if node.op == "placeholder":
                env[node] = args[self.positions[node]]
                continue
            if node.op == "output":
                return fx.node.map_arg(node.args[0], lambda n: env[n])
            if node.op == "call_module":
                piece = self.pieces[node.name]
                views = {}
                if streaming:
                    for group in piece.groups:
                        h._bring(group)
                        block = h._blocks[group]
                        if training:  # the parameters themselves: their gradients
                            h._train_through(group)
                            views[group] = block.params
                        else:
                            views[group] = _as_parameters(block, h._device_copy(group))
                inputs = [env[arg] if group is None or not streaming else views[group][slot]
                          for arg, group, slot in piece.inputs]
                env[node] = self._compiled(piece, inputs)(*inputs)
                del inputs, views
                if streaming:
                    for group in piece.groups:
                        if training:
                            h._untrain(group)
                        if group in piece.last:
                            h._end_of_graph(group)
                        else:
                            h._release(group)
            elif node.op == "call_function" and node.target is operator.getitem:
                env[node] = env[node.args[0]][node.args[1]]
            else:
                env[node] = node.target(*fx.node.map_arg(node.args, lambda n: env[n]),
                                        **fx.node.map_arg(node.kwargs, lambda n: env[n]))
            for used in node.all_input_nodes:
                left[used] -= 1
                if left[used] == 0 and used.op != "placeholder":
                    del env[used]
        raise RuntimeError("[weights] compiled: the cut graph has no output")

    def _compiled(self, piece: _Piece, inputs: list):
        key = (torch.is_grad_enabled(),) + tuple(
            (tuple(x.shape), x.stride(), x.dtype, x.device, x.requires_grad)
            if isinstance(x, torch.Tensor) else (type(x), x) for x in inputs)
        fn = piece.compiled.get(key)
        if fn is None:
            fn = self.backend(piece.module, list(inputs))
            piece.compiled[key] = fn
            self.handle._stats["piece_compiles"] = self.handle._stats.get("piece_compiles", 0) + 1
        return fn


def _as_parameters(block, buffer: torch.Tensor) -> list[torch.Tensor]:
    """The group's weights in its device buffer, each flagged requires_grad as its
    parameter is: some kernels choose their path by it even without autograd recording
    (the CPU's multi-head attention), and a piece must compute what it computes on the
    parameters themselves."""
    return [v.requires_grad_() if p.requires_grad else v
            for v, p in zip(block.views(buffer), block.params)]


def _canonical_names(module: fx.GraphModule) -> None:
    """Names the piece's values by position (a0, a1, ... for its inputs, v0, v1, ... for
    the rest), so that the pieces of structurally identical blocks have the same code and
    the inner backend's caches (Inductor's FX graph cache) compile each shape of block
    once."""
    inputs = values = 0
    for node in module.graph.nodes:
        if node.op == "placeholder":
            node._rename(f"a{inputs}")
            node.target = node.name
            inputs += 1
        elif node.op != "output":
            node._rename(f"v{values}")
            values += 1
    module.recompile()


def _attr(module: nn.Module, target: str):
    for part in target.split("."):
        module = getattr(module, part, None)
    return module


def _owner(node: fx.Node, group_paths: dict[str, int], block_paths: set[str]):
    """The group a node belongs to by the module stack Dynamo recorded: the innermost
    group; "inside" for a node of a block outside its groups; "outside" for a node of no
    block; None without a module stack."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    found, inside = None, False
    for entry in stack.values():
        for path in _model_paths(entry[0] if isinstance(entry, tuple) else str(entry)):
            if path in group_paths:
                found = group_paths[path]
            if path in block_paths:
                inside = True
    if found is not None:
        return found
    return "inside" if inside else "outside"


def _model_paths(dynamo_path: str) -> list[str]:
    """The model paths a module path of Dynamo's may be: its dotted suffixes, since the
    root's name depends on how the model was called ("L['self'].model.layers[0]" and
    "L['args'][0].model.layers.0" both end in "model.layers.0")."""
    parts = [p for p in dynamo_path.replace("[", ".").replace("]", "").replace("'", "")
             .replace('"', "").split(".") if p and p != "_modules"]
    return [".".join(parts[k:]) for k in range(len(parts))]


class _Backend:
    """The torch.compile backend: one PiecewiseExecutor per captured graph."""

    def __init__(self, handle, inner: str):
        self.handle, self.inner = handle, inner
        self.graphs = 0

    def __call__(self, gm: fx.GraphModule, example_inputs):
        self.graphs += 1
        self.handle._stats["graphs"] = self.graphs
        return PiecewiseExecutor(self.handle, gm, example_inputs, _inner_backend(self.inner))


def _inner_backend(inner):
    if callable(inner):
        return inner
    if inner == "eager":
        return lambda gm, inputs: gm
    from torch._dynamo import lookup_backend
    return lookup_backend(inner)


def compile_offloaded(model: nn.Module, *, gpu_budget=None, blocks: str | None = None,
                      prefetch: int | None = None, granularity: str = "block", device=None,
                      device_profile=None, backend="inductor", **torch_compile_kwargs):
    """spillway.compile(model, weights="offload", ...): see spillway.compile."""
    from spillway.weights import layerwise
    if not isinstance(model, nn.Module):
        raise ValueError(f"[weights] compiled: model must be an nn.Module, got "
                         f"{type(model).__name__}")
    if not (callable(backend) or isinstance(backend, str)):
        raise ValueError(f"[weights] compiled: backend must be a backend name or callable, "
                         f"got {_shown(backend)}")
    handle = layerwise._attach(model, blocks, prefetch, gpu_budget, device, device_profile,
                               granularity, compiled=True)
    compiled = torch.compile(model, backend=_Backend(handle, backend), **torch_compile_kwargs)
    compiled.spillway_weights = handle
    # One call of the compiled model is one call of the handle, however many graphs
    # Dynamo cut it into (Note [Piecewise executor], graph breaks). The wrapper's hooks
    # run outside Dynamo: it is the frame Dynamo's own frames run inside.
    handle._hooks.append(compiled.register_forward_pre_hook(handle._on_model_start))
    handle._hooks.append(compiled.register_forward_hook(handle._on_model_end,
                                                        always_call=True))
    return compiled


__all__ = ["compile_offloaded", "PiecewiseExecutor"]

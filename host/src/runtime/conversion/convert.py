"""Wasmtron's model converter: turns a Triton repository's PyTorch or TensorFlow model into
ONNX with the tensor names Triton's backend for that platform gives it, then checks the ONNX
model against the framework on generated inputs.

Run by the server (`--converter-python`) or by `wasmtron convert` with a job as JSON on
standard input; prints one JSON line on standard output: what was done and measured, or why
the model cannot be converted. Everything else the frameworks print goes to standard error.
"""

import json
import os
import re
import sys
import traceback
import zipfile

import numpy as np

# Per-type tolerance of the check: |onnx - framework| <= atol + rtol * |framework|.
TOLERANCE = {
    "FP32": (1e-4, 1e-3), "FP64": (1e-6, 1e-6), "FP16": (1e-2, 1e-2), "BF16": (5e-2, 5e-2),
}
NUMPY = {
    "FP32": np.float32, "FP64": np.float64, "FP16": np.float16, "INT64": np.int64,
    "INT32": np.int32, "INT16": np.int16, "INT8": np.int8, "UINT8": np.uint8, "BOOL": np.bool_,
}


class Refused(Exception):
    """The model cannot be converted: `reason` says why, `hint` what to do instead."""

    def __init__(self, reason, hint=""):
        super().__init__(reason)
        self.reason = reason
        self.hint = hint


def shape_of(job, spec, sample):
    """A concrete shape for a config tensor: the batch dimension (when the model batches) and
    each variable (-1) dimension take a size that differs between samples."""
    dims = [d if d >= 0 else 2 + sample for d in spec["dims"]]
    if job["max_batch_size"] > 0:
        dims = [1 + sample] + dims
    return dims


def generate(job, spec, sample, rng):
    kind = spec["data_type"]
    shape = shape_of(job, spec, sample)
    if kind == "BF16":
        return rng.standard_normal(shape).astype(np.float32)
    dtype = NUMPY.get(kind)
    if dtype is None:
        raise Refused("input '%s' has type %s, which the converted model cannot take"
                      % (spec["name"], kind))
    if dtype == np.bool_:
        return rng.integers(0, 2, shape).astype(np.bool_)
    if np.issubdtype(dtype, np.integer):
        return rng.integers(0, 10, shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def dynamic_axes(job, specs):
    axes = {}
    for spec in specs:
        offset = 1 if job["max_batch_size"] > 0 else 0
        named = {}
        if offset:
            named[0] = "batch"
        for i, d in enumerate(spec["dims"]):
            if d < 0:
                named[i + offset] = "%s_%d" % (re.sub(r"\W", "_", spec["name"]), i + offset)
        if named:
            axes[spec["name"]] = named
    return axes


ORDINAL = re.compile(r"^.*__(\d+)$")


def ordinal(name):
    m = ORDINAL.match(name)
    return int(m.group(1)) if m else None


# --- PyTorch ---------------------------------------------------------------------------------

def torch_dtype(torch, kind):
    return {"BF16": torch.bfloat16}.get(kind)


def torchscript_positions(job, module):
    """Which argument of forward() each config input is, as Triton's PyTorch backend decides
    it: forward()'s argument names when every input is one, else the `<name>__<index>`
    convention, else the order of the config."""
    schema = module.forward.schema
    args = [a for a in schema.arguments if a.name != "self"]
    names = [a.name for a in args]
    inputs = job["inputs"]
    if len(args) == 1 and args[0].type.kind() == "DictType":
        return "dict", None
    if len(names) != len(inputs):
        raise Refused("configuration expects %d inputs, model provides %d (forward(%s))"
                      % (len(inputs), len(names), ", ".join(names)))
    if all(i["name"] in names for i in inputs):
        return "forward() argument names", [names.index(i["name"]) for i in inputs]
    if all(ordinal(i["name"]) is not None for i in inputs):
        positions = [ordinal(i["name"]) for i in inputs]
        if sorted(positions) != list(range(len(inputs))):
            raise Refused("inputs %s name positions %s, not each of 0..%d once"
                          % ([i["name"] for i in inputs], positions, len(inputs) - 1))
        return "<name>__<index>", positions
    return "config order", list(range(len(inputs)))


def output_positions(job):
    outputs = job["outputs"]
    if outputs and all(ordinal(o["name"]) is not None for o in outputs):
        return "<name>__<index>", [ordinal(o["name"]) for o in outputs]
    return "config order", list(range(len(outputs)))


def flat_outputs(torch, result):
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in result):
        return list(result)
    raise Refused("forward() returns %s; a converted model returns a tensor or a tuple or "
                  "list of tensors (dict outputs are served by torch_aoti's RESULT[key] names)"
                  % type(result).__name__)


def convert_torchscript(job, rng):
    import torch

    try:
        module = torch.jit.load(job["source"], map_location="cpu")
    except Exception as e:
        raise Refused("torch.jit.load cannot read %s: %s" % (os.path.basename(job["source"]), e),
                      "save the model with torch.jit.script(model).save(...) or "
                      "torch.jit.trace(model, example).save(...)")
    module.eval()
    convention, positions = torchscript_positions(job, module)
    out_convention, out_positions = output_positions(job)
    inputs, outputs = job["inputs"], job["outputs"]
    if positions is None:
        return convert_dict_input(job, torch, module, out_convention, out_positions, rng)

    def ordered(xs):
        placed = [None] * len(xs)
        for x, p in zip(xs, positions):
            placed[p] = x
        return placed

    def run(xs):
        flat = flat_outputs(torch, module(*ordered(xs)))
        for p in out_positions:
            if p >= len(flat):
                raise Refused("the config names output position %d, but forward() returns "
                              "%d tensors" % (p, len(flat)))
        return [flat[p] for p in out_positions]

    def export(xs, path, dynamo):
        args = tuple(ordered(xs))
        count = len(flat_outputs(torch, module(*args)))
        named = {p: o["name"] for p, o in zip(out_positions, outputs)}
        out_names = [named.get(p, "unused__%d" % p) for p in range(count)]
        in_names = ordered([i["name"] for i in inputs])
        if dynamo:
            from torch._export.converter import TS2EPConverter
            program = TS2EPConverter(module, args).convert()
            torch.onnx.export(program, args, path, input_names=in_names,
                              output_names=out_names, opset_version=opset(job), dynamo=True)
        else:
            torch.onnx.export(module, args, path, input_names=in_names, output_names=out_names,
                              dynamic_axes=dynamic_axes(job, inputs + outputs),
                              opset_version=opset(job), dynamo=False)
        keep_outputs(path, [o["name"] for o in outputs])

    notes = ["inputs by %s" % convention, "outputs by %s" % out_convention]
    return export_torch(job, torch, run, export, rng, notes)


def convert_dict_input(job, torch, module, out_convention, out_positions, rng):
    """A forward() that takes one Dict(str, Tensor), keyed by the config's input names (as
    Triton's PyTorch backend passes them): the TorchScript program is turned into an
    ExportedProgram first, whose module the exporter can trace with the dict built inside."""
    from torch._export.converter import TS2EPConverter

    inputs, outputs = job["inputs"], job["outputs"]
    names = [i["name"] for i in inputs]

    def pick(result):
        flat = flat_outputs(torch, result)
        for p in out_positions:
            if p >= len(flat):
                raise Refused("the config names output position %d, but forward() returns "
                              "%d tensors" % (p, len(flat)))
        return [flat[p] for p in out_positions]

    def run(xs):
        return pick(module(dict(zip(names, xs))))

    def export(xs, path, dynamo):
        program = TS2EPConverter(module, (dict(zip(names, xs)),)).convert()
        inner = program.module()
        # The exporters switch training mode, which an ExportedProgram's module refuses.
        inner.train = lambda mode=True: inner

        class Keyed(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.inner = inner

            def forward(self, *tensors):
                return tuple(pick(self.inner(dict(zip(names, tensors)))))

        torch.onnx.export(Keyed(), tuple(xs), path, input_names=names,
                          output_names=[o["name"] for o in outputs],
                          dynamic_axes=dynamic_axes(job, inputs + outputs) or None,
                          opset_version=opset(job), dynamo=dynamo)

    notes = ["inputs as the keys of forward()'s Dict(str, Tensor) argument",
             "outputs by %s" % out_convention]
    return export_torch(job, torch, run, export, rng, notes)


def opset(job):
    return job.get("opset", 17)


def keep_outputs(path, names):
    """Drops the graph outputs the config does not name (a model may return more)."""
    import onnx

    model = onnx.load(path)
    kept = [o for o in model.graph.output if o.name in names]
    if len(kept) != len(model.graph.output):
        del model.graph.output[:]
        model.graph.output.extend(kept)
        onnx.save(model, path)


def convert_exported_program(job, rng):
    import torch
    from torch.utils import _pytree as pytree

    source = job["source"]
    if zipfile.is_zipfile(source):
        with zipfile.ZipFile(source) as z:
            listed = z.namelist()
        compiled = [n for n in listed if n.endswith((".so", ".cubin", ".dll"))]
    else:
        listed, compiled = [], []
    try:
        program = torch.export.load(source)
    except Exception as e:
        if compiled:
            raise Refused(
                "%s is an AOTInductor-compiled package (native code for one machine, %s): it "
                "holds no graph to convert" % (os.path.basename(source), compiled[0]),
                "save the ExportedProgram: torch.export.save(torch.export.export(model, "
                "args), 'model.pt2'), or export to ONNX with torch.onnx.export(model, args, "
                "dynamo=True)")
        raise Refused("torch.export.load cannot read %s: %s" % (os.path.basename(source), e),
                      "save it with torch.export.save(torch.export.export(model, args), "
                      "'model.pt2')")
    example = getattr(program, "example_inputs", None)
    if example is None:
        raise Refused("the ExportedProgram carries no example inputs to learn its call "
                      "structure from", "export it with torch.export.export(model, args) on "
                      "torch 2.5 or newer")
    leaves, spec = pytree.tree_flatten_with_path(example)

    def name_of(path):
        first, rest = path[0].idx, path[1:]
        head = "ARGS" if first == 0 else "KWARGS"
        return head + "".join("[%s]" % (k.idx if hasattr(k, "idx") else k.key) for k in rest)

    call_names = [name_of(path) for path, _ in leaves]
    inputs = job["inputs"]
    if len(call_names) != len(inputs):
        raise Refused("configuration expects %d inputs, the program takes %d (%s)"
                      % (len(inputs), len(call_names), ", ".join(call_names)))
    index = {}
    for n, spec_in in enumerate(inputs):
        name = spec_in["name"]
        if name in call_names:
            index[n] = call_names.index(name)
        elif ordinal(name) is not None and name.startswith("INPUT__"):
            index[n] = ordinal(name)
        else:
            raise Refused("input '%s' is neither a call name (%s) nor INPUT__<index>"
                          % (name, ", ".join(call_names)))
    module = program.module()
    sample = [l for _, l in leaves]
    with torch.no_grad():
        result = module(*example[0], **example[1])
    out_leaves, _ = pytree.tree_flatten_with_path(result)
    out_names = ["RESULT" + "".join("[%s]" % (k.idx if hasattr(k, "idx") else k.key)
                                    for k in path) for path, _ in out_leaves]
    out_index = []
    for o in job["outputs"]:
        name = o["name"]
        if name in out_names:
            out_index.append(out_names.index(name))
        elif name.startswith("OUTPUT__") and ordinal(name) is not None \
                and ordinal(name) < len(out_names):
            out_index.append(ordinal(name))
        else:
            raise Refused("output '%s' is neither a result name (%s) nor OUTPUT__<index>"
                          % (name, ", ".join(out_names)))

    class Wrapped(torch.nn.Module):
        """forward(*inputs in config order) -> outputs in config order."""

        def __init__(self):
            super().__init__()
            self.inner = module

        def forward(self, *xs):
            flat = list(sample)
            for n, x in enumerate(xs):
                flat[index[n]] = x
            args, kwargs = pytree.tree_unflatten(flat, spec)
            out = pytree.tree_leaves(self.inner(*args, **kwargs))
            return tuple(out[i] for i in out_index)

    # An ExportedProgram's module has no training mode to switch, and the exporters switch it.
    module.train = lambda mode=True: module
    wrapped = Wrapped()

    def export(xs, path, dynamo):
        axes = dynamic_axes(job, inputs + job["outputs"]) or None
        torch.onnx.export(wrapped, tuple(xs), path, input_names=[i["name"] for i in inputs],
                          output_names=[o["name"] for o in job["outputs"]],
                          dynamic_axes=axes, opset_version=opset(job), dynamo=dynamo)

    notes = ["inputs by ARGS/KWARGS or INPUT__<index>", "outputs by RESULT or OUTPUT__<index>"]
    return export_torch(job, torch, lambda xs: wrapped(*xs), export, rng, notes)


def export_torch(job, torch, run, export, rng, notes):
    """Runs the model on generated inputs, exports it (the TorchScript-based exporter, then
    the dynamo one), and checks the ONNX model's answers against the framework's."""
    inputs, outputs = job["inputs"], job["outputs"]
    samples = [[generate(job, i, s, rng) for i in inputs] for s in range(2)]

    def tensors(sample):
        out = []
        for spec, a in zip(inputs, sample):
            t = torch.from_numpy(np.ascontiguousarray(a))
            special = torch_dtype(torch, spec["data_type"])
            out.append(t.to(special) if special is not None else t)
        return out

    def reference(sample):
        with torch.no_grad():
            out = run(tensors(sample))
        return [o.detach().to(torch.float32).numpy() if o.dtype == torch.bfloat16
                else o.detach().numpy() for o in out]

    expected = []
    for sample in samples:
        try:
            expected.append(reference(sample))
        except Refused:
            raise
        except Exception as e:
            if not expected:
                raise Refused("the model fails on inputs of the configured shapes %s: %s"
                              % ([list(a.shape) for a in sample], first_line(e)))
            expected.append(None)  # a second shape the model does not take
    errors = []
    exporter = None
    for dynamo in (False, True):
        try:
            with torch.no_grad():
                with_warnings_quiet(lambda: export(tensors(samples[0]), job["output"], dynamo))
            exporter = "torch.onnx.export(dynamo=%s)" % dynamo
            break
        except Refused:
            raise
        except Exception as e:
            errors.append("%s: %s" % ("dynamo exporter" if dynamo else "TorchScript exporter",
                                      first_line(e)))
    if exporter is None:
        raise Refused("ONNX cannot express this model: " + "; ".join(errors),
                      "export it to ONNX yourself with torch.onnx.export(model, args, "
                      "dynamo=True), or keep the logic the exporter cannot trace in a Wasm "
                      "stage")
    checks = verify(job, samples, expected)
    return {
        "framework": "torch " + torch.__version__,
        "exporter": exporter,
        "opset": opset(job),
        "notes": notes,
        "checks": checks,
    }


# --- TensorFlow ------------------------------------------------------------------------------

def convert_saved_model(job, rng):
    import tensorflow as tf
    from tensorflow.core.protobuf import saved_model_pb2

    source = job["source"]
    pb = os.path.join(source, "saved_model.pb")
    if not os.path.isfile(pb):
        raise Refused("%s is not a SavedModel directory (no saved_model.pb)" % source,
                      "save it with tf.saved_model.save(model, dir) or model.export(dir)")
    saved = saved_model_pb2.SavedModel()
    with open(pb, "rb") as f:
        saved.ParseFromString(f.read())
    signature_name = job.get("signature") or "serving_default"
    tag = job.get("tag") or "serve"
    graphs = [g for g in saved.meta_graphs if tag in g.meta_info_def.tags]
    if not graphs:
        raise Refused("the SavedModel has no graph tagged '%s' (TF_GRAPH_TAG)" % tag)
    signatures = graphs[0].signature_def
    if signature_name not in signatures:
        raise Refused("the SavedModel has no signature '%s' (TF_SIGNATURE_DEF; it has: %s)"
                      % (signature_name, ", ".join(sorted(signatures))))
    signature = signatures[signature_name]
    ins = {key: t.name for key, t in signature.inputs.items()}
    outs = {key: t.name for key, t in signature.outputs.items()}
    import subprocess
    cmd = [sys.executable, "-m", "tf2onnx.convert", "--saved-model", source,
           "--signature_def", signature_name, "--tag", tag, "--opset", str(job.get("opset", 17)),
           "--output", job["output"]]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        tail = [ln for ln in done.stdout.splitlines() if "Error" in ln or "error" in ln]
        raise Refused("tf2onnx cannot convert the SavedModel: %s"
                      % (tail[-1] if tail else done.stdout[-500:]),
                      "keep the logic tf2onnx cannot convert in a Wasm stage")
    import onnx
    model = onnx.load(job["output"])
    rename = {v: k for k, v in ins.items()}
    rename.update({v: k for k, v in outs.items()})
    rename_values(model, rename)
    onnx.save(model, job["output"])
    # The signature's own shapes and types, for the check (the config may leave them out).
    specs = {}
    for key, t in signature.inputs.items():
        dims = [d.size for d in t.tensor_shape.dim]
        specs[key] = {"name": key, "dtype": tf.dtypes.as_dtype(t.dtype).as_numpy_dtype,
                      "dims": dims}
    loaded = tf.saved_model.load(source, tags=[tag])
    fn = loaded.signatures[signature_name]
    samples, expected = [], []
    for s in range(2):
        feed = {}
        for key, spec in specs.items():
            shape = [d if d >= 0 else 1 + s for d in spec["dims"]]
            dtype = np.dtype(spec["dtype"])
            if np.issubdtype(dtype, np.floating):
                feed[key] = rng.standard_normal(shape).astype(dtype)
            elif dtype == np.bool_:
                feed[key] = rng.integers(0, 2, shape).astype(np.bool_)
            else:
                feed[key] = rng.integers(0, 10, shape).astype(dtype)
        got = fn(**{k: tf.constant(v) for k, v in feed.items()})
        samples.append(feed)
        expected.append({k: v.numpy() for k, v in got.items()})
    checks = verify_named(job["output"], samples, expected)
    return {
        "framework": "tensorflow " + tf.__version__,
        "exporter": "tf2onnx " + __import__("tf2onnx").__version__,
        "opset": job.get("opset", 17),
        "notes": ["tensors named by the signature '%s' keys" % signature_name],
        "checks": checks,
    }


def rename_values(model, rename):
    """Renames graph inputs and outputs (and every use of them) in an ONNX model."""
    g = model.graph
    for value in list(g.input) + list(g.output):
        if value.name in rename:
            value.name = rename[value.name]
    for node in g.node:
        for i, n in enumerate(node.input):
            if n in rename:
                node.input[i] = rename[n]
        for i, n in enumerate(node.output):
            if n in rename:
                node.output[i] = rename[n]


# --- the check -------------------------------------------------------------------------------

def session(path):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def compare(name, kind, got, want):
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        return {"output": name, "ok": False,
                "detail": "shape %s, the framework gives %s" % (list(got.shape),
                                                                 list(want.shape))}
    if kind in TOLERANCE or np.issubdtype(want.dtype, np.floating):
        atol, rtol = TOLERANCE.get(kind, TOLERANCE["FP32"])
        diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
        bound = atol + rtol * np.abs(want.astype(np.float64))
        worst = float(diff.max()) if diff.size else 0.0
        ok = bool(np.all(diff <= bound)) and not np.isnan(diff).any()
        return {"output": name, "ok": ok, "max_abs_error": worst,
                "tolerance": "atol %g + rtol %g" % (atol, rtol)}
    equal = bool(np.array_equal(got, want))
    return {"output": name, "ok": equal, "max_abs_error": 0.0 if equal else None,
            "tolerance": "exact"}


def verify(job, samples, expected):
    s = session(job["output"])
    checks = []
    for sample, want in zip(samples, expected):
        if want is None:
            continue
        feed = {}
        for spec, a in zip(job["inputs"], sample):
            feed[spec["name"]] = a
        got = s.run([o["name"] for o in job["outputs"]], feed)
        for o, g, w in zip(job["outputs"], got, want):
            checks.append(dict(compare(o["name"], o["data_type"], g, w),
                               shape=list(np.shape(w))))
    return merge(checks)


def verify_named(path, samples, expected):
    s = session(path)
    names = [o.name for o in s.get_outputs()]
    checks = []
    for feed, want in zip(samples, expected):
        got = s.run(names, feed)
        for n, g in zip(names, got):
            if n in want:
                checks.append(dict(compare(n, "", g, want[n]), shape=list(np.shape(want[n]))))
    return merge(checks)


def merge(checks):
    """One entry per output: the worst error over the samples."""
    merged = {}
    for c in checks:
        m = merged.setdefault(c["output"], dict(c, samples=0, shapes=[]))
        m["samples"] += 1
        m["shapes"].append(c.pop("shape", None))
        m.pop("shape", None)
        if not c["ok"]:
            m.update(c)
            m["ok"] = False
        elif m["ok"] and (c.get("max_abs_error") or 0) > (m.get("max_abs_error") or 0):
            m["max_abs_error"] = c["max_abs_error"]
    return list(merged.values())


ANSI = re.compile(r"\x1b\[[0-9;]*m")


def first_line(e):
    """The line of an exception that says what failed (an exporter's long report names the
    operator it has no translation for on a later line)."""
    lines = [ln.strip() for ln in ANSI.sub("", str(e)).splitlines() if ln.strip()]
    telling = [ln for ln in lines if re.search(r"aten::|[Nn]ot supported|[Uu]nsupported", ln)]
    pick = telling[0] if telling else (lines[0] if lines else "")
    return "%s: %s" % (type(e).__name__, pick[:400]) if pick else type(e).__name__


def with_warnings_quiet(f):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return f()


def main():
    # The answer goes to the real standard output; whatever the frameworks print (from Python
    # or native code) goes to standard error.
    answer = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    job = json.load(sys.stdin)
    rng = np.random.default_rng(0)
    platform = job["platform"]
    try:
        if platform in ("pytorch_libtorch", "pytorch"):
            done = convert_torchscript(job, rng)
        elif platform == "torch_aoti":
            done = convert_exported_program(job, rng)
        elif platform in ("tensorflow_savedmodel", "tensorflow"):
            done = convert_saved_model(job, rng)
        else:
            raise Refused("no converter for platform '%s'" % platform)
        failed = [c for c in done["checks"] if not c["ok"]]
        if failed:
            raise Refused("the converted model does not answer as the framework does: %s"
                          % "; ".join("output '%s' %s" % (c["output"], c.get("detail") or
                                      "max abs error %g beyond %s" % (c["max_abs_error"],
                                                                      c["tolerance"]))
                                      for c in failed))
        print(json.dumps(dict(done, ok=True)), file=answer)
    except Refused as e:
        print(json.dumps({"ok": False, "reason": e.reason, "hint": e.hint}), file=answer)
    except ModuleNotFoundError as e:
        print(json.dumps({"ok": False, "reason": "the converter's Python has no module '%s'"
                          % e.name, "hint": "install the framework into the converter's "
                          "environment (torch and onnx for PyTorch; tensorflow and tf2onnx "
                          "for TensorFlow; onnxruntime for the check)"}), file=answer)
    except Exception as e:
        traceback.print_exc()
        print(json.dumps({"ok": False, "reason": first_line(e), "hint": ""}), file=answer)
    finally:
        answer.flush()


if __name__ == "__main__":
    main()

//! The native part of the `gradpack` Python package: gradpack's codecs, frames, error
//! feedback and cost model over numpy arrays.
//!
//! The Python package (`gradpack/__init__.py`) wraps these functions: it turns torch
//! tensors, `bytearray`s and `memoryview`s into numpy views without copying and then
//! calls in here. Every function reads its arrays in place (a C-contiguous float32 array
//! is never copied), releases the GIL while a kernel runs, and turns a gradpack error into
//! the `gradpack.Error` exception (a `ValueError`) with the crate's own message.

use gradpack::collective::{
    AllReduce, AllReduceOptions, BucketGather, Comm, Feedback, Hierarchical, Nodes, ReduceOp,
    Routed, SharedMemory, SharedMemoryOptions, StrategyChoice, Transport,
};
use gradpack::cost::{self, CodecProfile, Strategy};
use gradpack::outer::{OuterOptions, OuterSync};
use gradpack::sync::{PowerSgd, PowerSgdBucket, Tensor};
use gradpack::{Codec, CodecSpec, EncodeCtx, FeedbackOptions, ResidualPrecision};
use numpy::{
    Element, PyArray1, PyArrayDescrMethods, PyArrayDyn, PyArrayMethods, PyReadonlyArray,
    PyReadonlyArrayDyn, PyReadwriteArray, PyReadwriteArrayDyn, PyUntypedArray,
    PyUntypedArrayMethods, ndarray::Dimension,
};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyDict};

mod hook;
mod net;
mod state;
mod tune;
use hook::PyHookReducer;
use net::{Net, PyTcp, link};
use state::{
    PyModelSelection, PyMomentum, PyNamedState, PyPowerSgdByName, PyTensorGather, default_strategy,
    wants_feedback,
};
use tune::{PyTuner, mean_over_ranks, tensor_codec};

// gradpack.Error, the exception every crate error raises, is a Python class (in
// `gradpack/_errors.py`): a subclass of ValueError that an abi3 module cannot define as a
// class of its own, and that the generated stubs then know.
pyo3::import_exception!(gradpack._errors, Error);

pub(crate) fn err(e: gradpack::Error) -> PyErr {
    // The crate names its Rust option; a Python caller has an argument for it.
    Error::new_err(e.to_string().replace(
        "FeedbackOptions::allow_non_contractive overrides this",
        "pass allow_non_contractive=True to use it anyway",
    ))
}

fn type_name(x: &Bound<'_, PyAny>) -> String {
    x.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into())
}

/// The float32 array `x` as a read-only view, or a clear TypeError / ValueError.
fn f32_in<'py>(x: &Bound<'py, PyAny>, what: &str) -> PyResult<PyReadonlyArrayDyn<'py, f32>> {
    let a = f32_array(x, what)?;
    a.try_readonly().map_err(|e| {
        PyValueError::new_err(format!(
            "{what}: the array is being written elsewhere ({e})"
        ))
    })
}

/// `x` as float32: a bfloat16 or float16 torch tensor, or a float16 or bfloat16
/// (ml_dtypes) numpy array, widened (exactly: every such value is a float32 value, and
/// `lossless:dtype=bf16` or `fp16` sends it to the bit); anything else as it is.
fn widened<'py>(x: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    if is_torch_tensor(x)? {
        let dt = x.getattr("dtype")?.str()?.to_string();
        if dt == "torch.bfloat16" || dt == "torch.float16" {
            return x.call_method0("float");
        }
    } else if let Ok(a) = x.cast::<PyUntypedArray>() {
        let name = a.dtype().getattr("name")?.str()?.to_string();
        if name == "float16" || name == "bfloat16" {
            return x.call_method1("astype", ("float32",));
        }
    }
    Ok(x.clone())
}

/// The float32 array `x` as a writable view.
fn f32_out<'py>(x: &Bound<'py, PyAny>, what: &str) -> PyResult<PyReadwriteArrayDyn<'py, f32>> {
    let a = f32_array(x, what)?;
    a.try_readwrite().map_err(|e| {
        PyValueError::new_err(format!(
            "{what} must be a writable array with no other live borrow ({e})"
        ))
    })
}

/// The elements of a borrowed array as a slice (the borrow checks made it contiguous).
fn slice_in<'a, T: Element, D: Dimension>(a: &'a PyReadonlyArray<'_, T, D>) -> PyResult<&'a [T]> {
    a.as_slice()
        .map_err(|e| PyValueError::new_err(e.to_string()))
}

/// The elements of a writable borrowed array as a slice.
fn slice_out<'a, T: Element, D: Dimension>(
    a: &'a mut PyReadwriteArray<'_, T, D>,
) -> PyResult<&'a mut [T]> {
    a.as_slice_mut()
        .map_err(|e| PyValueError::new_err(e.to_string()))
}

/// Whether `x` is a `torch.Tensor` (torch imported already; it is never imported here).
fn is_torch_tensor(x: &Bound<'_, PyAny>) -> PyResult<bool> {
    let py = x.py();
    let modules = py.import("sys")?.getattr("modules")?;
    match modules.get_item("torch") {
        Ok(torch) => x.is_instance(&torch.getattr("Tensor")?),
        Err(_) => Ok(false),
    }
}

/// `x` as a numpy array of `dtype` (`"float32"` or `"uint8"`) without a copy: a numpy
/// array as it is, a CPU torch tensor of that dtype (contiguous) through its `numpy()`
/// view, or any object with the buffer protocol (bytearray, memoryview, array.array)
/// of that format; else the error that says why not.
fn as_ndarray<'py>(x: &Bound<'py, PyAny>, what: &str, dtype: &str) -> PyResult<Bound<'py, PyAny>> {
    let py = x.py();
    if x.cast::<PyUntypedArray>().is_ok() {
        return Ok(x.clone());
    }
    if is_torch_tensor(x)? {
        let device: String = x.getattr("device")?.getattr("type")?.extract()?;
        if device != "cpu" {
            return Err(PyValueError::new_err(format!(
                "{what} is on device {device}; gradpack reads host memory: pass {what}.cpu() \
                 (gradpack.torch's hook copies CUDA buckets to the host itself)"
            )));
        }
        let has = x.getattr("dtype")?.str()?.to_string();
        if has != format!("torch.{dtype}") {
            let hint = if dtype == "float32" {
                " (convert with t.float())"
            } else {
                ""
            };
            return Err(PyTypeError::new_err(format!(
                "{what} has dtype {has}; gradpack reads torch.{dtype} only{hint}"
            )));
        }
        if !x.call_method0("is_contiguous")?.extract::<bool>()? {
            return Err(PyValueError::new_err(format!(
                "{what} is not contiguous; pass {what}.contiguous()"
            )));
        }
        let a = x.call_method0("detach")?.call_method0("numpy")?;
        // A uint8 tensor is a byte buffer, read flat (a contiguous view).
        return if dtype == "uint8" {
            a.call_method1("reshape", (-1,))
        } else {
            Ok(a)
        };
    }
    let view = py
        .import("builtins")?
        .getattr("memoryview")?
        .call1((x,))
        .map_err(|_| {
            let msg = if dtype == "float32" {
                format!("{what} must be a float32 numpy array, a CPU torch tensor or a buffer of float32")
            } else {
                format!(
                    "{} must be bytes, bytearray, memoryview, a 1-D uint8 array or a uint8 torch tensor",
                    if what == "frame" { "a frame" } else { what }
                )
            };
            PyTypeError::new_err(format!("{msg}, not {}", type_name(x)))
        })?;
    let format: String = view.getattr("format")?.extract()?;
    let ok = match dtype {
        "float32" => ["f", "<f", "=f", "@f"].contains(&format.as_str()),
        _ => ["B", "b", "c", "<B", "=B", "@B"].contains(&format.as_str()),
    };
    if !ok {
        let code = if dtype == "float32" { "f" } else { "B" };
        return Err(PyTypeError::new_err(format!(
            "{what} is a buffer of format {format:?}; gradpack reads {dtype} ('{code}') only"
        )));
    }
    let np = py.import("numpy")?;
    np.call_method1("frombuffer", (view, np.getattr(dtype)?))
}

fn f32_array<'py>(x: &Bound<'py, PyAny>, what: &str) -> PyResult<Bound<'py, PyArrayDyn<f32>>> {
    let py = x.py();
    let x = &as_ndarray(x, what, "float32")?;
    let arr = x.cast::<PyUntypedArray>().map_err(|_| {
        PyTypeError::new_err(format!(
            "{what} must be a numpy.ndarray of float32 (or a CPU float32 torch tensor), not {}",
            type_name(x)
        ))
    })?;
    let dt = arr.dtype();
    if !dt.is_equiv_to(&numpy::dtype::<f32>(py)) {
        return Err(PyTypeError::new_err(format!(
            "{what} has dtype {}; gradpack reads native-endian float32 only \
             (convert with x.astype(numpy.float32))",
            dt.str().map(|s| s.to_string()).unwrap_or_default()
        )));
    }
    if !arr.is_c_contiguous() {
        return Err(PyValueError::new_err(format!(
            "{what} is not C-contiguous (strides {:?}); pass numpy.ascontiguousarray(x)",
            arr.strides()
        )));
    }
    Ok(arr.cast::<PyArrayDyn<f32>>()?.clone())
}

/// A frame: `bytes`, or a C-contiguous one-dimensional uint8 numpy array.
enum FrameIn<'py> {
    Bytes(Bound<'py, PyBytes>),
    Array(numpy::PyReadonlyArray1<'py, u8>),
}

impl FrameIn<'_> {
    fn as_slice(&self) -> PyResult<&[u8]> {
        match self {
            FrameIn::Bytes(b) => Ok(b.as_bytes()),
            FrameIn::Array(a) => a
                .as_slice()
                .map_err(|e| PyValueError::new_err(format!("frame: {e}"))),
        }
    }
}

fn frame_in<'py>(x: &Bound<'py, PyAny>) -> PyResult<FrameIn<'py>> {
    if let Ok(b) = x.cast::<PyBytes>() {
        return Ok(FrameIn::Bytes(b.clone()));
    }
    let x = &as_ndarray(x, "frame", "uint8")?;
    if let Ok(a) = x.cast::<PyUntypedArray>()
        && (a.ndim() != 1 || !a.dtype().is_equiv_to(&numpy::dtype::<u8>(x.py())))
    {
        let dt = a.dtype().str().map(|s| s.to_string()).unwrap_or_default();
        return Err(PyTypeError::new_err(format!(
            "a frame array must be 1-D uint8, got {}-D {dt}",
            a.ndim()
        )));
    }
    if let Ok(a) = x.cast::<numpy::PyArray1<u8>>() {
        if !a.is_c_contiguous() {
            return Err(PyValueError::new_err("frame array is not contiguous"));
        }
        return a
            .try_readonly()
            .map(FrameIn::Array)
            .map_err(|e| PyValueError::new_err(format!("frame: {e}")));
    }
    Err(PyTypeError::new_err(format!(
        "a frame must be bytes, bytearray, memoryview or a 1-D uint8 array, not {}",
        type_name(x)
    )))
}

/// A writable 1-D uint8 array to encode into.
fn bytes_out<'py>(x: &Bound<'py, PyAny>) -> PyResult<numpy::PyReadwriteArray1<'py, u8>> {
    let x = &as_ndarray(x, "out", "uint8")?;
    let a = x.cast::<numpy::PyArray1<u8>>().map_err(|_| {
        PyTypeError::new_err(format!(
            "out must be a 1-D uint8 numpy array (or a uint8 torch tensor), not {}",
            type_name(x)
        ))
    })?;
    if !a.is_c_contiguous() {
        return Err(PyValueError::new_err("out is not contiguous"));
    }
    a.try_readwrite()
        .map_err(|e| PyValueError::new_err(format!("out must be writable ({e})")))
}

/// `x` as an unsigned 64-bit argument `what`: an int (a numpy integer too) in
/// 0 .. 2**64 - 1, or the error that says what is wrong.
fn u64_named(x: &Bound<'_, PyAny>, what: &str) -> PyResult<u64> {
    let n = match x.is_instance_of::<pyo3::types::PyBool>() {
        true => None,
        false => x.call_method0("__index__").ok(),
    };
    let Some(n) = n else {
        return Err(PyTypeError::new_err(format!(
            "{what} must be an int, not {}",
            type_name(x)
        )));
    };
    n.extract::<u64>().map_err(|_| {
        let negative = n.lt(0).unwrap_or(false);
        let hint = if negative {
            format!(" (for a negative one, pass {what} % 2**64)")
        } else {
            String::new()
        };
        PyValueError::new_err(format!("{what} must be in 0 .. 2**64 - 1, not {n}{hint}"))
    })
}

/// An int argument taken modulo 2**64 (a seed or key that may be negative).
fn u64_wrapped(x: &Bound<'_, PyAny>) -> PyResult<u64> {
    if x.is_instance_of::<pyo3::types::PyBool>() {
        return Err(PyTypeError::new_err("an int is needed, not a bool"));
    }
    let n = x
        .call_method0("__index__")
        .map_err(|_| PyTypeError::new_err(format!("an int is needed, not {}", type_name(x))))?;
    n.call_method1("__and__", (u64::MAX,))?.extract()
}

fn seed_arg(x: &Bound<'_, PyAny>) -> PyResult<u64> {
    u64_named(x, "seed")
}

fn offset_arg(x: &Bound<'_, PyAny>) -> PyResult<u64> {
    u64_named(x, "offset")
}

fn spec_of(codec: &Bound<'_, PyAny>) -> PyResult<CodecSpec> {
    if let Ok(c) = codec.cast::<PyCodec>() {
        return Ok(c.get().spec);
    }
    if let Ok(s) = codec.extract::<String>() {
        return s.parse().map_err(err);
    }
    Err(PyTypeError::new_err(format!(
        "codec must be a spec string such as 'int8' or a gradpack.Codec, not {}",
        type_name(codec)
    )))
}

fn ctx(seed: u64, offset: u64) -> EncodeCtx {
    EncodeCtx::new(seed).with_offset(offset)
}

/// Encode `x` with `spec` into `out`, sealing with a payload CRC-32 when `checksum`.
fn encode_slice(
    spec: &CodecSpec,
    x: &[f32],
    c: &EncodeCtx,
    checksum: bool,
    out: &mut [u8],
) -> gradpack::Result<usize> {
    if checksum {
        gradpack::Checksummed(*spec).encode_into(x, c, out)
    } else {
        spec.encode_into(x, c, out)
    }
}

/// Encode `x` into a new frame (the crate's owning `encode`, which checks the arguments
/// and the allocation first), copied into a Python `bytes`.
fn encode_to_bytes<'py>(
    py: Python<'py>,
    spec: &CodecSpec,
    x: &Bound<'py, PyAny>,
    seed: u64,
    offset: u64,
    checksum: bool,
) -> PyResult<Bound<'py, PyBytes>> {
    let x = &widened(x)?;
    let arr = f32_in(x, "x")?;
    let xs = slice_in(&arr)?;
    let c = ctx(seed, offset);
    let frame = py
        .detach(|| {
            if checksum {
                gradpack::Checksummed(*spec).encode(xs, &c)
            } else {
                spec.encode(xs, &c)
            }
        })
        .map_err(err)?;
    Ok(PyBytes::new(py, &frame))
}

/// Encode the float32 array ``x`` (any shape, read flat) into a frame. A bfloat16 or
/// float16 tensor or array is widened to float32 first (exactly: with
/// ``lossless:dtype=bf16`` or ``dtype=fp16`` its frame decodes to the same values).
///
/// ``seed`` drives stochastic rounding and random-k selection (the same seed gives the
/// same frame on every CPU); ``offset`` is the global index of ``x``'s first element in
/// its tensor when ``x`` is a chunk; ``checksum`` seals the payload with a CRC-32 that
/// decoding verifies.
#[pyfunction]
#[pyo3(signature = (x, codec, seed=0, offset=0, checksum=false))]
fn encode<'py>(
    py: Python<'py>,
    x: &Bound<'py, PyAny>,
    codec: &Bound<'py, PyAny>,
    #[pyo3(from_py_with = seed_arg)] seed: u64,
    #[pyo3(from_py_with = offset_arg)] offset: u64,
    checksum: bool,
) -> PyResult<Bound<'py, PyBytes>> {
    let spec = spec_of(codec)?;
    encode_to_bytes(py, &spec, x, seed, offset, checksum)
}

/// Encode ``x`` into ``out`` (a uint8 numpy array, uint8 torch tensor or bytearray
/// of at least ``Codec(codec).max_encoded_len(x.size)`` bytes) and return the frame
/// length. Allocates nothing.
#[pyfunction]
#[pyo3(signature = (x, out, codec, seed=0, offset=0, checksum=false))]
fn encode_into<'py>(
    py: Python<'py>,
    x: &Bound<'py, PyAny>,
    out: &Bound<'py, PyAny>,
    codec: &Bound<'py, PyAny>,
    #[pyo3(from_py_with = seed_arg)] seed: u64,
    #[pyo3(from_py_with = offset_arg)] offset: u64,
    checksum: bool,
) -> PyResult<usize> {
    let spec = spec_of(codec)?;
    let x = &widened(x)?;
    let arr = f32_in(x, "x")?;
    let xs = slice_in(&arr)?;
    let mut o = bytes_out(out)?;
    let os = slice_out(&mut o)?;
    let c = ctx(seed, offset);
    py.detach(|| {
        spec.check_encode(xs.len(), &c)?;
        encode_slice(&spec, xs, &c, checksum, os)
    })
    .map_err(err)
}

/// Decode any frame into a new 1-D float32 array.
///
/// A frame needs no configuration: its header names the codec and parameters. Frames
/// claiming more than ``max_elements`` elements (default: the most a frame of its
/// length can legitimately hold) are refused before anything is allocated.
#[pyfunction]
#[pyo3(signature = (frame, max_elements=None))]
fn decode<'py>(
    py: Python<'py>,
    frame: &Bound<'py, PyAny>,
    max_elements: Option<u64>,
) -> PyResult<Bound<'py, PyArray1<f32>>> {
    let f = frame_in(frame)?;
    let fs = f.as_slice()?;
    let limit = max_elements.unwrap_or_else(|| gradpack::decode_limit(fs.len()));
    let v = py
        .detach(|| gradpack::decode_to_vec_with_limit(fs, limit))
        .map_err(err)?;
    Ok(PyArray1::from_vec(py, v))
}

fn decode_mode<'py>(
    py: Python<'py>,
    frame: &Bound<'py, PyAny>,
    out: &Bound<'py, PyAny>,
    add: bool,
) -> PyResult<()> {
    let f = frame_in(frame)?;
    let fs = f.as_slice()?;
    let mut o = f32_out(out, if add { "acc" } else { "out" })?;
    let os = slice_out(&mut o)?;
    py.detach(|| {
        if add {
            gradpack::decode_add(fs, os)
        } else {
            gradpack::decode(fs, os)
        }
    })
    .map_err(err)
}

/// Check that every rank of `world` passes the same `settings` (`key=value` words
/// separated by spaces), over the message callables of the collectives: each rank sends
/// its settings to every other and compares what each sends, so a difference raises on
/// every rank, naming the rank and the option. One exchange of its own.
#[pyfunction]
#[pyo3(signature = (
    settings, rank=None, world=None, send=None, recv=None, *, tag=u32::MAX, send_recv=None,
    transport=None,
))]
#[allow(clippy::too_many_arguments)]
fn agree(
    py: Python<'_>,
    settings: &str,
    rank: Option<usize>,
    world: Option<usize>,
    send: Option<Py<PyAny>>,
    recv: Option<Py<PyAny>>,
    tag: u32,
    send_recv: Option<Py<PyAny>>,
    transport: Option<&Bound<'_, PyTcp>>,
) -> PyResult<()> {
    let t = link(py, "agree", rank, world, send, recv, send_recv, transport)?;
    let mut comm = Comm::new(t);
    py.detach(|| comm.agree(tag, settings)).map_err(err)
}

/// Estimate the link between the ranks as `(bandwidth bit/s, latency s)` by timing
/// float32 ring all-reduces of `small` and `large` elements over the transport (the best
/// of `repeats` each) and solving the ring's model for both; the times are averaged over
/// the ranks, so every rank returns the same figures (pass them to `Tuner` or the cost
/// model). A collective on the transport given, with the GIL released.
#[pyfunction]
#[pyo3(signature = (
    rank=None, world=None, send=None, recv=None, *, small=1024, large=4194304, repeats=5,
    tag=u32::MAX - 2, send_recv=None, transport=None,
))]
#[allow(clippy::too_many_arguments)]
fn measure_link(
    py: Python<'_>,
    rank: Option<usize>,
    world: Option<usize>,
    send: Option<Py<PyAny>>,
    recv: Option<Py<PyAny>>,
    small: usize,
    large: usize,
    repeats: usize,
    tag: u32,
    send_recv: Option<Py<PyAny>>,
    transport: Option<&Bound<'_, PyTcp>>,
) -> PyResult<(f64, f64)> {
    let t = link(
        py,
        "measure_link",
        rank,
        world,
        send,
        recv,
        send_recv,
        transport,
    )?;
    let mut comm = Comm::new(t);
    let l = py
        .detach(|| gradpack::collective::measure_link(&mut comm, tag, small, large, repeats))
        .map_err(err)?;
    Ok((l.bandwidth_bit_s, l.latency_s))
}

/// Decode any frame into ``out``, a writable C-contiguous float32 array (or CPU
/// tensor) holding exactly the frame's element count, in any shape.
#[pyfunction]
fn decode_into<'py>(
    py: Python<'py>,
    frame: &Bound<'py, PyAny>,
    out: &Bound<'py, PyAny>,
) -> PyResult<()> {
    decode_mode(py, frame, out, false)
}

/// Decode any frame and add it element-wise into ``acc`` (the reduce step of a
/// collective). The frame is fully validated first: on error ``acc`` is unchanged.
#[pyfunction]
fn decode_add<'py>(
    py: Python<'py>,
    frame: &Bound<'py, PyAny>,
    acc: &Bound<'py, PyAny>,
) -> PyResult<()> {
    decode_mode(py, frame, acc, true)
}

/// Decode every frame of ``frames`` (frames of one tensor, of any codecs) and sum
/// them into ``out`` in list order, in one pass over it: the same bits as
/// ``decode_into`` of the first and ``decode_add`` of each of the others, but the
/// output is written once instead of once per frame (the sum of an all-gather).
///
/// With ``add=True`` every frame is added into ``out``. Every header, length and
/// fixed-rate payload is checked before ``out`` is written; an error names the
/// frame's position in the list.
#[pyfunction]
#[pyo3(signature = (frames, out, add=false))]
fn reduce_frames<'py>(
    py: Python<'py>,
    frames: &Bound<'py, PyAny>,
    out: &Bound<'py, PyAny>,
    add: bool,
) -> PyResult<()> {
    let mut held = Vec::new();
    for f in frames.try_iter()? {
        held.push(frame_in(&f?)?);
    }
    let slices = held
        .iter()
        .map(FrameIn::as_slice)
        .collect::<PyResult<Vec<&[u8]>>>()?;
    let mut o = f32_out(out, "out")?;
    let os = slice_out(&mut o)?;
    py.detach(|| {
        if add {
            gradpack::reduce_frames_add(&slices, os)
        } else {
            gradpack::reduce_frames(&slices, os)
        }
    })
    .map_err(err)
}

/// Validate a frame's header and describe it.
///
/// Returns a dict with ``codec``, ``spec``, ``elements``, ``payload_len``,
/// ``frame_len``, ``seed``, ``offset``, ``nonfinite`` (the input held NaN or Inf),
/// ``checksum`` (the payload is sealed) and ``bits_per_element``.
#[pyfunction]
fn inspect<'py>(py: Python<'py>, frame: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyDict>> {
    let f = frame_in(frame)?;
    let fs = f.as_slice()?;
    let (h, spec) = gradpack::inspect(fs).map_err(err)?;
    let d = PyDict::new(py);
    d.set_item("codec", h.codec.name())?;
    d.set_item("spec", spec.to_string())?;
    d.set_item("elements", h.elements)?;
    d.set_item("payload_len", h.payload_len)?;
    d.set_item("frame_len", h.frame_len().unwrap_or(u64::MAX))?;
    d.set_item("seed", h.seed)?;
    d.set_item("offset", h.offset)?;
    d.set_item("nonfinite", h.nonfinite())?;
    d.set_item("checksum", h.payload_checksum())?;
    d.set_item(
        "bits_per_element",
        if h.elements == 0 {
            0.0
        } else {
            8.0 * fs.len() as f64 / h.elements as f64
        },
    )?;
    Ok(d)
}

/// The length of the frame at the start of ``buf``, from its header alone (which is
/// checked): to cut a frame out of a longer buffer, such as a padded receive buffer.
#[pyfunction]
fn frame_len(buf: &Bound<'_, PyAny>) -> PyResult<u64> {
    let f = frame_in(buf)?;
    let h = gradpack::Header::parse(f.as_slice()?).map_err(err)?;
    h.frame_len()
        .ok_or_else(|| Error::new_err("frame length overflows u64"))
}

/// A codec and its parameters, parsed from a spec string.
///
/// Specs are ``name`` or ``name:key=value,...``: ``'fp16'``, ``'bf16'``,
/// ``'fp8:format=e4m3,block=128'`` (OCP 8-bit floats, E4M3 or E5M2, with an f32 or
/// E8M0 scale per block, or ``scale=none``), ``'int8:block=256,rounding=stochastic'``, ``'qsgd:bits=4'``, ``'sign'``,
/// ``'ternary'``, ``'natural'``, ``'topk:ratio=0.01,values=fp16'``,
/// ``'randk:ratio=0.01'``, ``'dct:chunk=64,k=4'`` (a DCT per tile of ``chunk``
/// elements, its ``k`` largest coefficients kept; ``width=`` for 2-D tiles),
/// ``'identity'`` (float32). Parameters not given take their defaults; :attr:`spec`
/// spells them all out.
#[pyclass(module = "gradpack", name = "Codec", frozen, eq)]
#[derive(PartialEq)]
struct PyCodec {
    spec: CodecSpec,
}

#[pymethods]
impl PyCodec {
    #[new]
    fn new(spec: &Bound<'_, PyAny>) -> PyResult<Self> {
        Ok(PyCodec {
            spec: spec_of(spec)?,
        })
    }

    /// The canonical spec, every parameter spelled out; parses back to an equal codec.
    #[getter]
    fn spec(&self) -> String {
        self.spec.to_string()
    }

    /// The codec's name (`'int8'`, `'topk'`, ...).
    #[getter]
    fn name(&self) -> &'static str {
        self.spec.id().name()
    }

    /// Whether decode(encode(x)) equals x in expectation.
    #[getter]
    fn unbiased(&self) -> bool {
        self.spec.unbiased()
    }

    /// Bits per element on the wire for a tensor of `n` elements, header included.
    fn bits_per_element(&self, n: usize) -> f64 {
        self.spec.bits_per_element(n)
    }

    /// The longest frame `n` elements can encode to (a buffer this long always
    /// suffices), plus 4 bytes with `checksum`.
    #[pyo3(signature = (n, checksum=false))]
    fn max_encoded_len(&self, n: usize, checksum: bool) -> usize {
        if checksum {
            gradpack::Checksummed(self.spec).max_encoded_len(n)
        } else {
            self.spec.max_encoded_len(n)
        }
    }

    /// The largest error of one decoded element for inputs with absolute maximum
    /// `absmax` (infinite for codecs that drop elements).
    fn error_bound(&self, absmax: f64) -> f64 {
        self.spec.error_bound(absmax)
    }

    /// Encode `x`; see `gradpack.encode`.
    #[pyo3(signature = (x, seed=0, offset=0, checksum=false))]
    fn encode<'py>(
        &self,
        py: Python<'py>,
        x: &Bound<'py, PyAny>,
        #[pyo3(from_py_with = seed_arg)] seed: u64,
        #[pyo3(from_py_with = offset_arg)] offset: u64,
        checksum: bool,
    ) -> PyResult<Bound<'py, PyBytes>> {
        encode_to_bytes(py, &self.spec, x, seed, offset, checksum)
    }

    /// Encode `x` into the uint8 buffer `out`; see `gradpack.encode_into`.
    #[pyo3(signature = (x, out, seed=0, offset=0, checksum=false))]
    fn encode_into<'py>(
        slf: &Bound<'py, Self>,
        x: &Bound<'py, PyAny>,
        out: &Bound<'py, PyAny>,
        #[pyo3(from_py_with = seed_arg)] seed: u64,
        #[pyo3(from_py_with = offset_arg)] offset: u64,
        checksum: bool,
    ) -> PyResult<usize> {
        encode_into(slf.py(), x, out, slf.as_any(), seed, offset, checksum)
    }

    fn __hash__(&self) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        self.spec.to_string().hash(&mut h);
        h.finish()
    }

    /// Pickles as its spec.
    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> (Bound<'py, pyo3::types::PyType>, (String,)) {
        (slf.get_type(), (slf.get().spec.to_string(),))
    }

    fn __repr__(&self) -> String {
        format!("Codec('{}')", self.spec)
    }

    fn __str__(&self) -> String {
        self.spec.to_string()
    }
}

/// Error feedback for one tensor of ``n`` elements.
///
/// Each :meth:`encode` sends ``beta * residual + gamma * grad`` and keeps what the codec
/// dropped as the next residual, in the same pass as the encode. Codecs that are not
/// contractive (random-k with ``scale=unbiased``, QSGD with few levels per block) make
/// the residual grow and are refused unless ``allow_non_contractive``. ``residual``
/// is ``'f32'`` (exact) or ``'bf16'`` (half the memory; fixed-rate codecs only).
///
/// The state survives a checkpoint: :meth:`state_dict` returns plain values (a
/// versioned, checksummed blob inside) that :meth:`load_state_dict` restores bit for
/// bit.
#[pyclass(module = "gradpack", name = "ErrorFeedback")]
struct PyErrorFeedback {
    inner: gradpack::ErrorFeedback,
}

fn precision(name: &str) -> PyResult<ResidualPrecision> {
    match name {
        "f32" | "float32" => Ok(ResidualPrecision::F32),
        "bf16" | "bfloat16" => Ok(ResidualPrecision::Bf16),
        _ => Err(PyValueError::new_err(format!(
            "residual precision {name:?}: use 'f32' or 'bf16'"
        ))),
    }
}

/// The entry `key` of a saved state dict of `what` (a class name), or a clear error.
fn state_item<'py>(
    state: &Bound<'py, PyAny>,
    what: &str,
    key: &str,
) -> PyResult<Bound<'py, PyAny>> {
    state
        .get_item(key)
        .map_err(|_| PyValueError::new_err(format!("{what} state has no {key:?} entry")))
}

/// The blob of a state dict of `what` saved in format `expected`, after checking the
/// format.
fn state_blob<'py>(
    state: &Bound<'py, PyAny>,
    what: &str,
    expected: &str,
) -> PyResult<Bound<'py, PyBytes>> {
    let format: String = state_item(state, what, "format")?.extract()?;
    if format != expected {
        return Err(PyValueError::new_err(format!(
            "{what} state format {format:?}, expected {expected:?}"
        )));
    }
    state_item(state, what, "blob")?
        .cast_into::<PyBytes>()
        .map_err(|_| PyTypeError::new_err(format!("{what} state 'blob' must be bytes")))
}

const STATE_FORMAT: &str = "gradpack.ErrorFeedback/1";

#[pymethods]
impl PyErrorFeedback {
    #[new]
    #[pyo3(signature = (codec, n, beta=1.0, gamma=1.0, residual="f32", allow_non_contractive=false))]
    fn new(
        codec: &Bound<'_, PyAny>,
        n: usize,
        beta: f32,
        gamma: f32,
        residual: &str,
        allow_non_contractive: bool,
    ) -> PyResult<Self> {
        let opts = feedback_options(beta, gamma, residual, allow_non_contractive)?;
        Ok(PyErrorFeedback {
            inner: gradpack::ErrorFeedback::with_options(spec_of(codec)?, n, opts).map_err(err)?,
        })
    }

    /// The codec.
    #[getter]
    fn codec(&self) -> PyCodec {
        PyCodec {
            spec: self.inner.codec(),
        }
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    /// Bytes of residual state.
    #[getter]
    fn memory_bytes(&self) -> usize {
        self.inner.memory_bytes()
    }

    /// The longest frame `encode` can return (plus 4 bytes with `checksum`).
    #[pyo3(signature = (checksum=false))]
    fn max_encoded_len(&self, checksum: bool) -> usize {
        let n = self.inner.max_encoded_len();
        if checksum {
            gradpack::wire::sealed_len(n)
        } else {
            n
        }
    }

    /// Encode `grad` plus the residual, and keep the new residual.
    #[pyo3(signature = (grad, seed=0, offset=0, checksum=false))]
    fn encode<'py>(
        &mut self,
        py: Python<'py>,
        grad: &Bound<'py, PyAny>,
        #[pyo3(from_py_with = seed_arg)] seed: u64,
        #[pyo3(from_py_with = offset_arg)] offset: u64,
        checksum: bool,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let arr = f32_in(grad, "grad")?;
        let g = slice_in(&arr)?;
        let c = ctx(seed, offset);
        let ef = &mut self.inner;
        let frame = py
            .detach(|| {
                let mut f = ef.encode(g, &c)?;
                if checksum {
                    let len = f.len();
                    f.resize(gradpack::wire::sealed_len(len), 0);
                    gradpack::wire::seal(&mut f, len)?;
                }
                Ok(f)
            })
            .map_err(err)?;
        Ok(PyBytes::new(py, &frame))
    }

    /// Encode into the uint8 array `out` (at least `max_encoded_len()` bytes); returns
    /// the frame length.
    #[pyo3(signature = (grad, out, seed=0, offset=0, checksum=false))]
    fn encode_into<'py>(
        &mut self,
        py: Python<'py>,
        grad: &Bound<'py, PyAny>,
        out: &Bound<'py, PyAny>,
        #[pyo3(from_py_with = seed_arg)] seed: u64,
        #[pyo3(from_py_with = offset_arg)] offset: u64,
        checksum: bool,
    ) -> PyResult<usize> {
        let mut o = bytes_out(out)?;
        let os = slice_out(&mut o)?;
        self.encode_slice(py, grad, os, seed, offset, checksum)
    }

    /// A copy of the residual as float32.
    fn residual<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<f32>> {
        PyArray1::from_vec(py, self.inner.residual_f32())
    }

    /// Replace the residual with the float32 array `r` of `len(self)` elements (rounded
    /// to bf16 for a bf16 residual).
    fn set_residual(&mut self, r: &Bound<'_, PyAny>) -> PyResult<()> {
        let a = f32_in(r, "residual")?;
        let rs = slice_in(&a)?;
        self.inner.set_residual(rs).map_err(err)
    }

    /// Zero the residual.
    fn reset(&mut self) {
        self.inner.reset();
    }

    /// The state as a dict of plain values (format tag, codec spec, length, and a
    /// versioned, checksummed blob), for `torch.save` or pickle.
    fn state_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("format", STATE_FORMAT)?;
        d.set_item("codec", self.inner.codec().to_string())?;
        d.set_item("len", self.inner.len())?;
        d.set_item("blob", PyBytes::new(py, &self.inner.save()))?;
        Ok(d)
    }

    /// Restore a state saved by `state_dict` (same codec and length); bit-identical.
    fn load_state_dict(&mut self, state: &Bound<'_, PyAny>) -> PyResult<()> {
        let blob = state_blob(state, "ErrorFeedback", STATE_FORMAT)?;
        self.inner.restore(blob.as_bytes()).map_err(err)
    }

    fn __repr__(&self) -> String {
        format!(
            "ErrorFeedback('{}', n={})",
            self.inner.codec(),
            self.inner.len()
        )
    }
}

impl PyErrorFeedback {
    fn encode_slice<'py>(
        &mut self,
        py: Python<'py>,
        grad: &Bound<'py, PyAny>,
        out: &mut [u8],
        seed: u64,
        offset: u64,
        checksum: bool,
    ) -> PyResult<usize> {
        let arr = f32_in(grad, "grad")?;
        let g = slice_in(&arr)?;
        let c = ctx(seed, offset);
        let ef = &mut self.inner;
        py.detach(|| {
            let limit = if checksum {
                out.len().saturating_sub(gradpack::wire::PAYLOAD_CRC_LEN)
            } else {
                out.len()
            };
            let len = ef.encode_into(g, &c, &mut out[..limit])?;
            if checksum {
                gradpack::wire::seal(out, len)
            } else {
                Ok(len)
            }
        })
        .map_err(err)
    }
}

/// PowerSGD's arithmetic and state for one bucket of matrices whose two all-reduces
/// the caller runs (over torch's process group, say). See `gradpack.PowerSgdBucket`.
/// A transport whose messages go through two Python callables, `send(msg: bytearray, to:
/// int)` (the message's own copy, which the callee may keep) and `recv(frm: int) ->
/// bytes-like`; the GIL is taken only around those calls.
pub(crate) struct PyTransport {
    rank: usize,
    size: usize,
    send: Py<PyAny>,
    recv: Py<PyAny>,
    /// `send_recv(msg: bytearray, to: int, frm: int) -> bytes-like`, when given: one
    /// message sent and one received together, for transports that move both at once
    /// only when the receive is posted first (gloo's point-to-point does).
    send_recv: Option<Py<PyAny>>,
    /// Whether `send_recv` takes a keyword `size`: the length the received message is
    /// expected to have, where the collective knows it.
    sized: bool,
    /// Whether `recv` and `send_recv` take a keyword `limit`: the most bytes the
    /// collective expects, so that a longer announced length is refused before the
    /// callable allocates for it.
    limited: (bool, bool),
}

fn transport_error(peer: usize, what: &str, e: &PyErr) -> gradpack::Error {
    gradpack::Error::Transport {
        peer,
        reason: format!("{what} raised {e}"),
    }
}

impl Transport for PyTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn send(&mut self, msg: &[u8], to: usize) -> gradpack::Result<()> {
        Python::attach(|py| {
            self.send
                .call1(py, (PyByteArray::new(py, msg), to))
                .map(drop)
                .map_err(|e| transport_error(to, "send", &e))
        })
    }

    fn recv(&mut self, buf: &mut Vec<u8>, from: usize, max: usize) -> gradpack::Result<()> {
        Python::attach(|py| {
            let kw = keywords(
                py,
                [
                    (None, "size"),
                    (Some(max).filter(|_| self.limited.0), "limit"),
                ],
            )
            .map_err(|e| transport_error(from, "recv", &e))?;
            let got = self
                .recv
                .call(py, (from,), kw.as_ref())
                .map_err(|e| transport_error(from, "recv", &e))?;
            received(got.bind(py), buf, from, "recv", max)
        })
    }

    fn send_recv(
        &mut self,
        send: &[u8],
        to: usize,
        recv: &mut Vec<u8>,
        from: usize,
        max: usize,
    ) -> gradpack::Result<()> {
        self.exchange(send, to, recv, from, None, max)
    }

    fn send_recv_len(
        &mut self,
        send: &[u8],
        to: usize,
        recv: &mut Vec<u8>,
        from: usize,
        len: usize,
        max: usize,
    ) -> gradpack::Result<()> {
        self.exchange(send, to, recv, from, Some(len).filter(|_| self.sized), max)
    }
}

impl PyTransport {
    /// One message sent and one received: through `send_recv` when given (with the
    /// keyword `size` when there is one), else `send` then `recv`.
    fn exchange(
        &mut self,
        send: &[u8],
        to: usize,
        recv: &mut Vec<u8>,
        from: usize,
        size: Option<usize>,
        max: usize,
    ) -> gradpack::Result<()> {
        let Some(f) = &self.send_recv else {
            self.send(send, to)?;
            return self.recv(recv, from, max);
        };
        Python::attach(|py| {
            let limit = Some(max).filter(|_| self.limited.1);
            let kw = keywords(py, [(size, "size"), (limit, "limit")])
                .map_err(|e| transport_error(from, "send_recv", &e))?;
            let got = f
                .call(py, (PyByteArray::new(py, send), to, from), kw.as_ref())
                .map_err(|e| transport_error(from, "send_recv", &e))?;
            received(got.bind(py), recv, from, "send_recv", max)
        })
    }
}

/// The keyword arguments among `args` that have a value (none: no dictionary).
fn keywords<'py>(
    py: Python<'py>,
    args: [(Option<usize>, &str); 2],
) -> PyResult<Option<Bound<'py, PyDict>>> {
    if args.iter().all(|(v, _)| v.is_none()) {
        return Ok(None);
    }
    let kw = PyDict::new(py);
    for (v, name) in args {
        if let Some(v) = v {
            kw.set_item(name, v)?;
        }
    }
    Ok(Some(kw))
}

/// Whether the callable `f` takes a keyword argument `name` (by its signature; false
/// where it has none that `inspect` can read).
fn takes(py: Python<'_>, f: &Py<PyAny>, name: &str) -> bool {
    (|| -> PyResult<bool> {
        let sig = py.import("inspect")?.call_method1("signature", (f,))?;
        sig.getattr("parameters")?.contains(name)
    })()
    .unwrap_or(false)
}

/// What a receiving callable returned, copied into `buf`.
fn received(
    got: &Bound<'_, PyAny>,
    buf: &mut Vec<u8>,
    from: usize,
    what: &str,
    max: usize,
) -> gradpack::Result<()> {
    let f = frame_in(got).map_err(|e| transport_error(from, what, &e))?;
    let bytes = f.as_slice().map_err(|e| transport_error(from, what, &e))?;
    if bytes.len() > max {
        return Err(gradpack::Error::Transport {
            peer: from,
            reason: format!(
                "{what} returned a message of {} bytes where the collective expects at most {max}",
                bytes.len()
            ),
        });
    }
    buf.clear();
    buf.try_reserve_exact(bytes.len())
        .map_err(|_| gradpack::Error::OutOfMemory {
            bytes: bytes.len() as u64,
            what: "a received message",
        })?;
    buf.extend_from_slice(bytes);
    Ok(())
}

fn feedback_of(name: &str) -> PyResult<Feedback> {
    match name {
        "none" => Ok(Feedback::None),
        "worker" => Ok(Feedback::Worker),
        "worker+owner" => Ok(Feedback::WorkerAndOwner),
        _ => Err(PyValueError::new_err(format!(
            "feedback {name:?}: one of 'none', 'worker', 'worker+owner'"
        ))),
    }
}

/// The strategy argument of the collectives: `"auto"` (the cost model on links of
/// `bandwidth` bit/s and `latency` s) or a strategy's name.
fn strategy_choice(
    strategy: &str,
    world: usize,
    bandwidth: f64,
    latency: f64,
) -> PyResult<StrategyChoice> {
    if strategy == "auto" {
        check_cluster(world.max(1) as u32, bandwidth, latency, 1.0)?;
        Ok(StrategyChoice::Auto {
            bandwidth_bit_s: bandwidth,
            latency_s: latency,
            profile: None,
        })
    } else {
        Ok(StrategyChoice::Forced(self::strategy(strategy).map_err(
            |_| {
                PyValueError::new_err(format!(
                    "strategy {strategy:?}: one of 'auto', {}",
                    quoted(Strategy::ALL.map(Strategy::name))
                ))
            },
        )?))
    }
}

/// One collective call with the GIL released: `f(Some(input), output)` from `x` into
/// `out`, or `f(None, data)` in place on `x` when `out` is None (the crate's in-place runs
/// take no copy of the input). Returns the call's `strategy`, `bytes_sent` and `messages`.
fn run_collective<'py>(
    py: Python<'py>,
    x: &Bound<'py, PyAny>,
    out: Option<&Bound<'py, PyAny>>,
    f: impl FnOnce(Option<&[f32]>, &mut [f32]) -> gradpack::Result<gradpack::collective::Stats> + Send,
) -> PyResult<Bound<'py, PyDict>> {
    let stats = match out {
        None => {
            let mut o = f32_out(x, "x")?;
            let os = slice_out(&mut o)?;
            py.detach(|| f(None, os))
        }
        Some(out) => {
            let a = f32_in(x, "x")?;
            let xs = slice_in(&a)?;
            let mut o = f32_out(out, "out")?;
            let os = slice_out(&mut o)?;
            py.detach(|| f(Some(xs), os))
        }
    }
    .map_err(err)?;
    stats_dict(py, &stats)
}

/// A collective call's `strategy`, `bytes_sent` and `messages`.
fn stats_dict<'py>(
    py: Python<'py>,
    stats: &gradpack::collective::Stats,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("strategy", stats.strategy.name())?;
    d.set_item("bytes_sent", stats.bytes_sent)?;
    d.set_item("messages", stats.messages)?;
    Ok(d)
}

/// The transport of rank `rank` of `world` over the two message callables.
pub(crate) fn py_transport(
    py: Python<'_>,
    rank: usize,
    world: usize,
    send: Py<PyAny>,
    recv: Py<PyAny>,
    send_recv: Option<Py<PyAny>>,
) -> PyResult<PyTransport> {
    for (what, f) in [
        ("send", Some(&send)),
        ("recv", Some(&recv)),
        ("send_recv", send_recv.as_ref()),
    ] {
        if f.is_some_and(|f| !f.bind(py).is_callable()) {
            return Err(PyTypeError::new_err(format!("{what} must be callable")));
        }
    }
    let sized = send_recv.as_ref().is_some_and(|f| takes(py, f, "size"));
    let limited = (
        takes(py, &recv, "limit"),
        send_recv.as_ref().is_some_and(|f| takes(py, f, "limit")),
    );
    Ok(PyTransport {
        rank,
        size: world,
        send,
        recv,
        send_recv,
        sized,
        limited,
    })
}

/// Open shared memory called `name` for rank `rank` of `world` among the ranks `host`,
/// waiting (without the GIL) up to `timeout` seconds for the host's other ranks.
#[allow(clippy::too_many_arguments)]
fn open_shared(
    py: Python<'_>,
    name: &str,
    rank: usize,
    world: usize,
    host: &[usize],
    timeout: f64,
    stage: usize,
    capacity: Option<usize>,
    job: u64,
) -> PyResult<SharedMemory> {
    if !(timeout.is_finite() && timeout > 0.0) {
        return Err(PyValueError::new_err(format!(
            "shared_memory_timeout must be a positive number of seconds, not {timeout}"
        )));
    }
    let mut opts = SharedMemoryOptions {
        timeout: std::time::Duration::from_secs_f64(timeout),
        stage,
        job,
        ..Default::default()
    };
    if let Some(c) = capacity {
        opts.capacity = c;
    }
    py.detach(|| SharedMemory::open(name, rank, world, host, opts))
        .map_err(err)
}

/// `base`, with the messages between the ranks of this host through shared memory:
/// `shared` a [`PySharedMemory`] to share, or a name for files of this collective's own
/// among the ranks `host` (made with a stage of `stage` bytes).
fn routed(
    py: Python<'_>,
    base: Net,
    shared: Option<&Bound<'_, PyAny>>,
    host: Option<Vec<usize>>,
    timeout: f64,
    stage: usize,
) -> PyResult<Routed<Net>> {
    let Some(shared) = shared else {
        return Routed::new(base, None).map_err(err);
    };
    if let Ok(s) = shared.cast::<PySharedMemory>() {
        if host.is_some() {
            return Err(PyValueError::new_err(
                "host= goes with a shared-memory name; a SharedMemory knows its host",
            ));
        }
        return Routed::sharing(base, Some(s.borrow().inner.clone())).map_err(err);
    }
    let name: String = shared.extract().map_err(|_| {
        PyTypeError::new_err("shared_memory must be a name (str) or a gradpack.SharedMemory")
    })?;
    let Some(host) = host else {
        return Err(PyValueError::new_err(
            "shared_memory needs the ranks of this host (host=)",
        ));
    };
    let shm = open_shared(
        py,
        &name,
        base.rank(),
        base.size(),
        &host,
        timeout,
        stage,
        None,
        0,
    )?;
    Routed::new(base, Some(shm)).map_err(err)
}

/// Shared-memory rings (and, with `stage` bytes, a stage for the two-level all-reduce's
/// reduction in place) between the ranks `host` of one host (this rank, `rank` of
/// `world`, among them), under the name `name` (letters, digits, `-`, `_`; the same on
/// the ranks of the host, new for each set). Each ring holds `capacity` bytes (a
/// multiple of 64, default 1 MiB; the same on the host's ranks): a longer message streams
/// through it. Construction waits up to `timeout` seconds for the host's other ranks.
/// `job` (an integer below 2**64, the same on the host's ranks, drawn anew for each job)
/// is recorded in each rank's file: a peer's file of another job is refused, so two jobs
/// that picked one name fail at set-up instead of pairing their ranks.
///
/// Pass it as `shared_memory=` to any number of `AllReduce`, `BucketGather` and
/// `Hierarchical` collectives of this rank: they share its memory (1 MiB per other rank
/// of the host, plus the stage) instead of mapping their own, which a job with a
/// collective per bucket of a large model would multiply past a container's `/dev/shm`
/// (often 64 MiB). Collectives that share one must run one at a time, in the same order
/// on every rank of the host (as the PyTorch hook runs its buckets).
#[pyclass(module = "gradpack", name = "SharedMemory", frozen)]
struct PySharedMemory {
    inner: std::sync::Arc<SharedMemory>,
}

#[pymethods]
impl PySharedMemory {
    #[new]
    #[pyo3(signature = (name, rank, world, host, *, timeout=300.0, stage=0, capacity=None, job=0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        name: &str,
        rank: usize,
        world: usize,
        host: Vec<usize>,
        timeout: f64,
        stage: usize,
        capacity: Option<usize>,
        job: u64,
    ) -> PyResult<Self> {
        let shm = open_shared(py, name, rank, world, &host, timeout, stage, capacity, job)?;
        Ok(PySharedMemory {
            inner: std::sync::Arc::new(shm),
        })
    }

    /// The ranks of this host, ascending.
    #[getter]
    fn host(&self) -> Vec<usize> {
        self.inner.host().to_vec()
    }

    /// Whether it has a stage (for the two-level all-reduce's reduction in place).
    #[getter]
    fn staged(&self) -> bool {
        self.inner.node_memory().is_some()
    }

    fn __repr__(&self) -> String {
        format!(
            "SharedMemory(host={:?}, staged={})",
            self.inner.host(),
            if self.staged() { "True" } else { "False" }
        )
    }
}

/// A stage for the two-level all-reduce's reduction inside a node in place, for a tensor
/// of `length` on `world` ranks: up to 4 MiB, in rounds.
fn stage_for(length: usize, world: usize) -> usize {
    length
        .saturating_mul(4)
        .min(4 << 20)
        .max(world.saturating_mul(4))
        .next_multiple_of(64)
}

/// The `op` argument of the collectives.
fn reduce_op(op: &str) -> PyResult<ReduceOp> {
    match op {
        "mean" => Ok(ReduceOp::Mean),
        "sum" => Ok(ReduceOp::Sum),
        _ => Err(PyValueError::new_err(format!("op {op:?}: 'mean' or 'sum'"))),
    }
}

/// The error-feedback arguments.
fn feedback_options(
    beta: f32,
    gamma: f32,
    residual: &str,
    allow_non_contractive: bool,
) -> PyResult<FeedbackOptions> {
    Ok(FeedbackOptions {
        beta,
        gamma,
        precision: precision(residual)?,
        allow_non_contractive,
    })
}

const ALLREDUCE_FORMAT: &str = "gradpack.AllReduce/1";

/// An all-reduce's error-feedback residuals, with its strategy and codec, as a dict.
fn allreduce_state<'py>(py: Python<'py>, a: &AllReduce) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("format", ALLREDUCE_FORMAT)?;
    d.set_item("codec", a.codec().to_string())?;
    d.set_item("len", a.len())?;
    d.set_item("strategy", a.strategy().name())?;
    d.set_item("blob", PyBytes::new(py, &a.save()))?;
    Ok(d)
}

/// Restore `allreduce_state`'s dict into `a` (made with the same arguments).
fn load_allreduce(a: &mut AllReduce, state: &Bound<'_, PyAny>) -> PyResult<()> {
    let blob = state_blob(state, "AllReduce", ALLREDUCE_FORMAT)?;
    let strategy: String = state_item(state, "AllReduce", "strategy")?.extract()?;
    if strategy != a.strategy().name() {
        return Err(PyValueError::new_err(format!(
            "AllReduce state was saved under strategy {strategy:?}, this one runs {:?}",
            a.strategy().name()
        )));
    }
    a.restore(blob.as_bytes()).map_err(err)
}

/// gradpack's compressed all-reduce of one tensor of ``length`` elements, on rank
/// ``rank`` of ``world``, over gradpack's native transport (``transport=``, a
/// :class:`Tcp`: no message passes through Python, and ``rank`` and ``world`` are the
/// transport's) or over any message transport you give as two callables:
///
/// - ``send(msg: bytearray, to: int)`` hands ``msg`` (a copy of its own, which the
///   callable may keep) to rank ``to`` and must return without waiting for ``to`` to
///   receive it (all ranks send before they receive);
/// - ``recv(frm: int)`` returns the next message from rank ``frm`` (bytes, bytearray or
///   a 1-D uint8 array), in the order ``frm`` sent them;
/// - optionally ``send_recv(msg: bytearray, to: int, frm: int)``: both at once,
///   returning the message from ``frm``, where ``to`` gets ``msg`` (the ring's and the
///   all-gather's steps). Give it when the transport moves both ways at once only if
///   the receive is posted before the send: torch's gloo point-to-point does (posted
///   after, the two directions of a step took twice as long on a shaped link), so
///   :mod:`gradpack.torch` exchanges the lengths first, then posts the receive. If it
///   takes a keyword ``size``, the ring passes ``size=`` the length the message from
///   ``frm`` must have wherever the codec fixes it (every fixed-rate codec), so that
///   the receive can be posted at once. A message of another length must raise (or be
///   received whole and returned); gloo aborts the process when a message is longer
///   than the receive posted for it, so a transport over gloo should honour ``size``
///   only while every rank's all-reduce is made alike and no call has failed.
/// - ``recv`` and ``send_recv`` that take a keyword ``limit`` are passed the most bytes
///   the collective expects from ``frm``: a transport that learns a message's length
///   before its bytes should raise when the length is above it, before allocating (a
///   damaged length must not take the machine's memory). A returned message longer than
///   ``limit`` fails the call either way.
///
/// The algorithms are the Rust crate's, the same that MPI and the in-process transport
/// run: ``strategy`` ``"ring"`` (a compressed reduce-scatter and all-gather, ``pieces``
/// per chunk pipelined, error feedback at the ``"worker"`` or ``"worker+owner"``),
/// ``"allgather"`` (each rank's frame to every rank, summed in one fused pass),
/// ``"twoshot"`` (each chunk encoded once for its owner, summed there and re-encoded
/// once, then sent to every rank: two steps of latency, the ring's bytes),
/// ``"majority"`` (sign vote), ``"fp32-ring"``, or ``"auto"`` (the cost model's choice
/// for links of ``bandwidth`` bit/s and ``latency`` s). Every rank ends each
/// :meth:`run` with the same output to the bit. Every message carries an envelope
/// (call, hop, tag, sender) and is checked on arrival, so a message from another call
/// or another all-reduce (give each its own ``tag``) is an error, not a wrong sum.
/// Kernels run with the GIL released; it is taken only to call ``send`` and ``recv``.
/// An exception raised by either ends the call with :class:`Error` naming the peer.
///
/// ``shared_memory`` (a name: letters, digits, ``-``, ``_``; the same on the ranks of a
/// host and new for each collective) sends the messages between the ranks ``host`` (the
/// ranks of this host, this one among them) through shared-memory rings instead of the
/// callables: two copies per message, no socket. Every rank of ``host`` must pass the
/// same name and list; the others use the callables. Construction waits up to
/// ``shared_memory_timeout`` seconds for the host's other ranks, and so does a receive.
/// A :class:`SharedMemory` instead of a name shares its rings with other collectives
/// (then leave ``host`` out).
#[pyclass(module = "gradpack", name = "AllReduce")]
struct PyAllReduce {
    inner: AllReduce,
    comm: Comm<Routed<Net>>,
}

#[pymethods]
impl PyAllReduce {
    #[new]
    #[pyo3(signature = (
        codec, length, rank=None, world=None, send=None, recv=None, *, strategy="auto",
        op="mean", feedback="none", pieces=1, checksum=true, tag=0, bandwidth=10e9,
        latency=10e-6, beta=1.0, gamma=1.0, residual="f32", allow_non_contractive=false,
        shared_memory=None, host=None, shared_memory_timeout=300.0, send_recv=None,
        transport=None,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        codec: &Bound<'_, PyAny>,
        length: usize,
        rank: Option<usize>,
        world: Option<usize>,
        send: Option<Py<PyAny>>,
        recv: Option<Py<PyAny>>,
        strategy: &str,
        op: &str,
        feedback: &str,
        pieces: usize,
        checksum: bool,
        tag: u32,
        bandwidth: f64,
        latency: f64,
        beta: f32,
        gamma: f32,
        residual: &str,
        allow_non_contractive: bool,
        shared_memory: Option<&Bound<'_, PyAny>>,
        host: Option<Vec<usize>>,
        shared_memory_timeout: f64,
        send_recv: Option<Py<PyAny>>,
        transport: Option<&Bound<'_, PyTcp>>,
    ) -> PyResult<Self> {
        let py = codec.py();
        let t = link(
            py,
            "AllReduce",
            rank,
            world,
            send,
            recv,
            send_recv,
            transport,
        )?;
        let world = t.size();
        let t = routed(py, t, shared_memory, host, shared_memory_timeout, 0)?;
        let strategy = strategy_choice(strategy, world, bandwidth, latency)?;
        let op = reduce_op(op)?;
        if pieces == 0 {
            return Err(PyValueError::new_err("pieces must be at least 1"));
        }
        let opts = AllReduceOptions {
            op,
            strategy,
            feedback: feedback_of(feedback)?,
            feedback_options: feedback_options(beta, gamma, residual, allow_non_contractive)?,
            checksum,
            tag,
            pieces,
        };
        let inner = AllReduce::new(spec_of(codec)?, length, &t, opts).map_err(err)?;
        Ok(PyAllReduce {
            inner,
            comm: Comm::new(t),
        })
    }

    /// One all-reduce of `x` (a float32 array of `len(self)` elements) into `out`, or in
    /// place when `out` is None. `seed` seeds the step's random draws and must be the
    /// same on every rank (change it every step). Every rank must call `run` the same
    /// number of times, in the same order as its other all-reduces on the same peers.
    /// Returns what this rank did: `strategy`, `bytes_sent`, `messages`.
    #[pyo3(signature = (x, out=None, seed=0))]
    fn run<'py>(
        &mut self,
        py: Python<'py>,
        x: &Bound<'py, PyAny>,
        out: Option<&Bound<'py, PyAny>>,
        #[pyo3(from_py_with = seed_arg)] seed: u64,
    ) -> PyResult<Bound<'py, PyDict>> {
        let (ar, comm) = (&mut self.inner, &mut self.comm);
        run_collective(py, x, out, |xs, os| match xs {
            Some(xs) => ar.run(comm, xs, os, seed),
            None => ar.run_in_place(comm, os, seed),
        })
    }

    /// The strategy this all-reduce runs (the cost model's choice for "auto").
    #[getter]
    fn strategy(&self) -> &'static str {
        self.inner.strategy().name()
    }

    /// The codec.
    #[getter]
    fn codec(&self) -> PyCodec {
        PyCodec {
            spec: self.inner.codec(),
        }
    }

    /// Calls made so far on this all-reduce's message stream.
    #[getter]
    fn calls(&self) -> u64 {
        self.comm.calls()
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    /// This rank's error-feedback residuals (strategy and codec with them), to restore
    /// with `load_state_dict` into an all-reduce made with the same arguments.
    fn state_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        allreduce_state(py, &self.inner)
    }

    /// Restore a state saved by `state_dict`; the next `run` continues bit for bit.
    fn load_state_dict(&mut self, state: &Bound<'_, PyAny>) -> PyResult<()> {
        load_allreduce(&mut self.inner, state)
    }

    fn __repr__(&self) -> String {
        format!(
            "AllReduce('{}', length={}, strategy='{}', rank={} of {})",
            self.inner.codec(),
            self.inner.len(),
            self.inner.strategy().name(),
            self.comm.rank(),
            self.comm.size()
        )
    }
}

/// The all-gather of a bucket of tensors that the caller encodes, each tensor with a
/// codec of its own, on rank ``rank`` of ``world``, over the same message callables as
/// :class:`AllReduce` (``send``, ``recv`` and optionally ``send_recv``, or
/// ``transport``; and its ``shared_memory``, ``host`` and ``shared_memory_timeout``).
///
/// Where :class:`AllReduce` owns one tensor's codec, seeds and residuals, here the
/// caller encodes (with :meth:`Codec.encode_into` or :meth:`ErrorFeedback.encode_into`,
/// so residuals can stay per parameter) and the crate moves and sums: each rank's
/// message (its frames for the bucket's tensors, concatenated in order) travels round
/// the ring as the ``"allgather"`` strategy's frames do, and each tensor's frames are
/// summed into its place in rank order in one fused pass (:func:`reduce_frames`), so
/// every rank ends with the same bits. ``op`` is ``"mean"`` or ``"sum"``; give each
/// collective on the same peers its own ``tag``. Kernels run with the GIL released.
#[pyclass(module = "gradpack", name = "BucketGather")]
struct PyBucketGather {
    inner: BucketGather,
    comm: Comm<Routed<Net>>,
    /// `encode_run`'s message, kept between calls.
    send: Vec<u8>,
}

#[pymethods]
impl PyBucketGather {
    #[new]
    #[pyo3(signature = (
        rank=None, world=None, send=None, recv=None, *, op="mean", tag=0, shared_memory=None,
        host=None, shared_memory_timeout=300.0, send_recv=None, transport=None,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        rank: Option<usize>,
        world: Option<usize>,
        send: Option<Py<PyAny>>,
        recv: Option<Py<PyAny>>,
        op: &str,
        tag: u32,
        shared_memory: Option<&Bound<'_, PyAny>>,
        host: Option<Vec<usize>>,
        shared_memory_timeout: f64,
        send_recv: Option<Py<PyAny>>,
        transport: Option<&Bound<'_, PyTcp>>,
    ) -> PyResult<Self> {
        let t = link(
            py,
            "BucketGather",
            rank,
            world,
            send,
            recv,
            send_recv,
            transport,
        )?;
        let t = routed(py, t, shared_memory, host, shared_memory_timeout, 0)?;
        let inner = BucketGather::new(&t, tag, reduce_op(op)?).map_err(err)?;
        Ok(PyBucketGather {
            inner,
            comm: Comm::new(t),
            send: Vec::new(),
        })
    }

    /// Gather every rank's `message` (its frames for the tensors at `segments` of `out`,
    /// `(start, length)` pairs, concatenated in that order) and set each segment of `out`
    /// to the sum (or mean) of the ranks' frames for it, in rank order; `max_message`
    /// bounds every rank's message. Returns this rank's `strategy`, `bytes_sent` and
    /// `messages`.
    #[pyo3(signature = (message, segments, out, max_message=None))]
    fn run<'py>(
        &mut self,
        py: Python<'py>,
        message: &Bound<'py, PyAny>,
        segments: Vec<(usize, usize)>,
        out: &Bound<'py, PyAny>,
        max_message: Option<usize>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let mut ranges = Vec::new();
        ranges
            .try_reserve_exact(segments.len())
            .map_err(|_| PyValueError::new_err("could not allocate the list of segments"))?;
        for (start, len) in segments {
            let end = start.checked_add(len).ok_or_else(|| {
                PyValueError::new_err(format!("segment ({start}, {len}) overflows"))
            })?;
            ranges.push(start..end);
        }
        let m = frame_in(message)?;
        let ms = m.as_slice()?;
        let mut o = f32_out(out, "out")?;
        let os = slice_out(&mut o)?;
        let (g, comm) = (&mut self.inner, &mut self.comm);
        let stats = py
            .detach(|| g.run(comm, ms, &ranges, max_message, os))
            .map_err(err)?;
        stats_dict(py, &stats)
    }

    /// Encode each of `parts` into one message and run it: a part is `(start, length,
    /// codec, key, feedback)`, the tensor `x[start : start + length]` encoded with
    /// `codec` (through the `ErrorFeedback` `feedback` when not None) and the seed the
    /// crate derives from `seed`, `step`, the tensor's `key` and this rank; each part's
    /// sum or mean over the ranks is written back into `x`. All in the crate with the
    /// GIL released; the message and a peer's are bounded by the parts' longest frames.
    #[pyo3(signature = (x, parts, *, seed, step, checksum=false))]
    #[allow(clippy::type_complexity)]
    fn encode_run<'py>(
        &mut self,
        py: Python<'py>,
        x: &Bound<'py, PyAny>,
        parts: Vec<(
            usize,
            usize,
            Bound<'py, PyAny>,
            Bound<'py, PyAny>,
            Option<PyRefMut<'py, PyErrorFeedback>>,
        )>,
        #[pyo3(from_py_with = u64_wrapped)] seed: u64,
        #[pyo3(from_py_with = u64_wrapped)] step: u64,
        checksum: bool,
    ) -> PyResult<Bound<'py, PyDict>> {
        let rank = self.inner.rank();
        let mut fbs = Vec::new();
        let mut specs = Vec::new();
        for (start, len, codec, key, fb) in parts {
            let end = start
                .checked_add(len)
                .ok_or_else(|| PyValueError::new_err(format!("part ({start}, {len}) overflows")))?;
            let c = spec_of(&codec)?;
            let key = u64_wrapped(&key)?;
            specs.push((
                start..end,
                c,
                gradpack::collective::tensor_seed(&c, seed, step, key, rank),
            ));
            fbs.push(fb);
        }
        let mut parts: Vec<gradpack::collective::Part<'_>> = specs
            .into_iter()
            .zip(fbs.iter_mut())
            .map(|((range, codec, seed), fb)| gradpack::collective::Part {
                range,
                codec,
                seed,
                feedback: fb.as_deref_mut().map(|f| &mut f.inner),
            })
            .collect();
        let mut o = f32_out(x, "x")?;
        let xs = slice_out(&mut o)?;
        let (g, comm, send) = (&mut self.inner, &mut self.comm, &mut self.send);
        let stats = py
            .detach(|| g.encode_run(comm, xs, &mut parts, checksum, send))
            .map_err(err)?;
        stats_dict(py, &stats)
    }

    /// Calls of `run` so far.
    #[getter]
    fn calls(&self) -> u64 {
        self.comm.calls()
    }

    fn __repr__(&self) -> String {
        format!(
            "BucketGather(rank={} of {})",
            self.inner.rank(),
            self.inner.size()
        )
    }
}

/// A PowerSGD bucket's exchange `run` on the bucket `m` over the all-reduces `first`
/// and `second`, with the GIL released.
pub(crate) fn exchange_on<F>(
    py: Python<'_>,
    m: &mut [f32],
    first: &Bound<'_, PyAllReduce>,
    second: &Bound<'_, PyAllReduce>,
    run: F,
) -> PyResult<bool>
where
    F: FnOnce(
            &mut [f32],
            (&mut AllReduce, &mut Comm<Routed<Net>>),
            (&mut AllReduce, &mut Comm<Routed<Net>>),
        ) -> gradpack::Result<bool>
        + Send,
{
    let (mut f, mut g) = (first.borrow_mut(), second.borrow_mut());
    let (f, g) = (&mut *f, &mut *g);
    py.detach(|| run(m, (&mut f.inner, &mut f.comm), (&mut g.inner, &mut g.comm)))
        .map_err(err)
}

/// PowerSGD's exchange arguments checked: two distinct all-reduces, and the float32
/// `(start, length)` ranges as ranges.
pub(crate) fn exchange_ranges(
    first: &Bound<'_, PyAllReduce>,
    second: &Bound<'_, PyAllReduce>,
    plain: &[(usize, usize)],
) -> PyResult<Vec<core::ops::Range<usize>>> {
    if first.is(second) {
        return Err(PyValueError::new_err(
            "PowerSGD's two all-reduces must be two collectives, not one",
        ));
    }
    plain
        .iter()
        .map(|&(at, n)| {
            at.checked_add(n)
                .map(|end| at..end)
                .ok_or_else(|| PyValueError::new_err(format!("a range ({at}, {n}) overflows")))
        })
        .collect()
}

/// PowerSGD (Vogels et al., 2019) for one bucket of matrices, whose two all-reduces
/// the caller runs: step by step as below, or all in the crate with :meth:`exchange`
/// on two :class:`AllReduce` (what ``gradpack.torch`` does).
///
/// ``shapes`` lists each matrix's ``(n, m, r)`` (see :func:`powersgd_matrix`); the
/// bucket's gradient is their row-major elements back to back, or, with ``offsets``
/// (one per matrix, ascending) and ``length``, a buffer of ``length`` elements holding
/// each matrix at its offset among other tensors, which the steps leave alone. One
/// step, on every rank with the same ``seed``::
///
///     b.p_step(m, seed, p)        # m becomes grad + residual; p = M Q (this rank's)
///     # all-reduce p, divide by the world size
///     b.q_step(m, p, q)           # orthonormalise p in place; q = M^T P
///     # all-reduce q, divide by the world size
///     ok = b.finish(m, p, q, out) # out = P Q^T; residual = M - out; Q kept
///                                 # (out=None: the result replaces M in m)
///
/// Every rank gets the same ``out`` to the bit when the all-reduces give every rank the
/// same bits. ``warm_start`` reuses each matrix's last ``Q``; ``feedback`` keeps what was
/// not sent. ``finish`` returns ``False`` and fills ``out`` with NaN when a factor was
/// not finite (a gradient overflowed on some rank); the residuals then keep their
/// values and the next step draws a fresh ``Q``. Arrays are float32 and are read and
/// written in place. The state is saved whole (:meth:`save`) or per matrix
/// (:meth:`matrix_state`), so it can follow a parameter into another bucket.
#[pyclass(module = "gradpack", name = "PowerSgdBucket")]
struct PyPowerSgd {
    inner: PowerSgdBucket,
}

fn settings(rank: usize, warm_start: bool, feedback: bool, min_compression: f64) -> PowerSgd {
    PowerSgd {
        rank,
        warm_start,
        feedback,
        min_compression,
        ..PowerSgd::default()
    }
}

/// A matrix's warm-start Q (if set) and residual, as numpy arrays.
type MatrixState<'py> = (Option<Bound<'py, PyArray1<f32>>>, Bound<'py, PyArray1<f32>>);

#[pymethods]
impl PyPowerSgd {
    #[new]
    #[pyo3(signature = (shapes, rank=2, warm_start=true, feedback=true, min_compression=2.0, offsets=None, length=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        shapes: Vec<Vec<usize>>,
        rank: usize,
        warm_start: bool,
        feedback: bool,
        min_compression: f64,
        offsets: Option<Vec<usize>>,
        length: Option<usize>,
    ) -> PyResult<Self> {
        let shapes = shapes
            .into_iter()
            .map(|s| match s[..] {
                [n, m, r] => Ok((n, m, r)),
                _ => Err(PyValueError::new_err(format!(
                    "a PowerSGD shape is (n, m, r), not {s:?}"
                ))),
            })
            .collect::<PyResult<Vec<_>>>()?;
        let s = settings(rank, warm_start, feedback, min_compression);
        let inner = match (offsets, length) {
            (None, None) => PowerSgdBucket::new(s, &shapes),
            (Some(at), Some(len)) if at.len() == shapes.len() => {
                let placed: Vec<_> = at.into_iter().zip(shapes).collect();
                PowerSgdBucket::at_offsets(s, &placed, len)
            }
            _ => {
                return Err(PyValueError::new_err(
                    "give both offsets (one per matrix) and length, or neither",
                ));
            }
        };
        Ok(PyPowerSgd {
            inner: inner.map_err(err)?,
        })
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    /// Elements of the first all-reduce (every matrix's P).
    #[getter]
    fn p_len(&self) -> usize {
        self.inner.p_len()
    }

    /// Elements of the second all-reduce (every matrix's Q).
    #[getter]
    fn q_len(&self) -> usize {
        self.inner.q_len()
    }

    /// Step 1: `m` (this rank's gradients of the bucket) becomes M = m + residual and
    /// `p` gets this rank's P = M Q.
    fn p_step(
        &mut self,
        py: Python<'_>,
        m: &Bound<'_, PyAny>,
        #[pyo3(from_py_with = u64_wrapped)] seed: u64,
        p: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let mut ma = f32_out(m, "m")?;
        let mut pa = f32_out(p, "p")?;
        let (ms, ps) = (slice_out(&mut ma)?, slice_out(&mut pa)?);
        let b = &mut self.inner;
        py.detach(|| b.p_step(ms, seed, ps)).map_err(err)
    }

    /// A whole step over the ranks: `p_step`, the float32 all-reduce `first` of every
    /// matrix's P followed by the tensors `plain` (`(start, length)` ranges of `m` that go
    /// as float32, written back with their mean), `q_step`, the all-reduce `second` of Q,
    /// and `finish` in place, all in the crate with the GIL released. `first` and
    /// `second` are float32 mean all-reduces of `p_len` plus the ranges' elements and of
    /// `q_len` elements. Returns `finish`'s flag.
    fn exchange(
        &mut self,
        py: Python<'_>,
        m: &Bound<'_, PyAny>,
        #[pyo3(from_py_with = u64_wrapped)] seed: u64,
        plain: Vec<(usize, usize)>,
        first: &Bound<'_, PyAllReduce>,
        second: &Bound<'_, PyAllReduce>,
    ) -> PyResult<bool> {
        let ranges = exchange_ranges(first, second, &plain)?;
        let mut ma = f32_out(m, "m")?;
        let ms = slice_out(&mut ma)?;
        let b = &mut self.inner;
        exchange_on(py, ms, first, second, |m, f, g| {
            b.exchange(m, seed, &ranges, f, g)
        })
    }

    /// Step 2: `p` is the mean over ranks; orthonormalised in place, and `q` gets this
    /// rank's Q = M^T P.
    fn q_step(
        &mut self,
        py: Python<'_>,
        m: &Bound<'_, PyAny>,
        p: &Bound<'_, PyAny>,
        q: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let ma = f32_in(m, "m")?;
        let mut pa = f32_out(p, "p")?;
        let mut qa = f32_out(q, "q")?;
        let (ms, ps, qs) = (slice_in(&ma)?, slice_out(&mut pa)?, slice_out(&mut qa)?);
        let b = &mut self.inner;
        py.detach(|| b.q_step(ms, ps, qs)).map_err(err)
    }

    /// Step 3: `q` is the mean over ranks; `out` (or `m` itself when `out` is None)
    /// gets P Q^T, the residuals and the warm start are kept. False (and the result all
    /// NaN) if the factors were not finite.
    #[pyo3(signature = (m, p, q, out=None))]
    fn finish(
        &mut self,
        py: Python<'_>,
        m: &Bound<'_, PyAny>,
        p: &Bound<'_, PyAny>,
        q: &Bound<'_, PyAny>,
        out: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        let (pa, qa) = (f32_in(p, "p")?, f32_in(q, "q")?);
        let (ps, qs) = (slice_in(&pa)?, slice_in(&qa)?);
        let b = &mut self.inner;
        match out {
            Some(out) => {
                let ma = f32_in(m, "m")?;
                let mut oa = f32_out(out, "out")?;
                let (ms, os) = (slice_in(&ma)?, slice_out(&mut oa)?);
                py.detach(|| b.finish(ms, ps, qs, os)).map_err(err)
            }
            None => {
                let mut ma = f32_out(m, "m")?;
                let ms = slice_out(&mut ma)?;
                py.detach(|| b.finish_in_place(ms, ps, qs)).map_err(err)
            }
        }
    }

    /// Matrix `i`'s state: (its warm-start Q as float32, or None; its residual).
    fn matrix_state<'py>(&self, py: Python<'py>, i: usize) -> PyResult<MatrixState<'py>> {
        let (q, e) = self.inner.matrix_state(i).map_err(err)?;
        Ok((
            q.map(|q| PyArray1::from_slice(py, q)),
            PyArray1::from_slice(py, e),
        ))
    }

    /// Set matrix `i`'s state as `matrix_state` gave it.
    #[pyo3(signature = (i, q, residual))]
    fn set_matrix_state(
        &mut self,
        i: usize,
        q: Option<&Bound<'_, PyAny>>,
        residual: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let ea = f32_in(residual, "residual")?;
        let qa = q.map(|q| f32_in(q, "q")).transpose()?;
        let qs = qa.as_ref().map(slice_in).transpose()?;
        self.inner
            .set_matrix_state(i, qs, slice_in(&ea)?)
            .map_err(err)
    }

    /// Zero the residuals and draw a fresh Q at the next step.
    fn reset(&mut self) {
        self.inner.reset();
    }

    /// The state as a versioned, checksummed blob.
    fn save<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.inner.save())
    }

    /// Restore a blob of `save` from a bucket of the same matrices and settings.
    fn restore(&mut self, blob: &[u8]) -> PyResult<()> {
        self.inner.restore(blob).map_err(err)
    }

    fn __repr__(&self) -> String {
        format!(
            "PowerSgdBucket(elements={}, rank={}, p_len={}, q_len={})",
            self.inner.len(),
            self.inner.settings().rank,
            self.inner.p_len(),
            self.inner.q_len()
        )
    }
}

/// The ``(n, m, r)`` PowerSGD sends a tensor of ``shape`` as: ``n = shape[0]``
/// rows, ``m`` the product of the other dimensions (a convolution's ``[out, in, kh,
/// kw]`` is ``out x (in kh kw)``), rank ``r = min(rank, n, m)``; or ``None`` for a
/// tensor of fewer than two dimensions or one that ``n m / ((n + m) r)`` says compresses
/// less than ``min_compression`` times.
#[pyfunction]
#[pyo3(signature = (shape, rank=2, min_compression=2.0))]
fn powersgd_matrix(
    shape: Vec<usize>,
    rank: usize,
    min_compression: f64,
) -> PyResult<Option<(usize, usize, usize)>> {
    let s = settings(rank, true, true, min_compression);
    s.check().map_err(err)?;
    Ok(s.matrix_of(&gradpack::sync::Tensor::new("", &shape)))
}

/// A codec's size on the wire and speed on this CPU, as the cost model uses them.
/// Speeds are bytes of float32 input per second.
#[pyclass(module = "gradpack", name = "CodecProfile", get_all, set_all)]
#[derive(Clone)]
struct PyProfile {
    spec: String,
    bits_per_element: f64,
    encode_bytes_per_s: f64,
    decode_bytes_per_s: f64,
    decode_add_bytes_per_s: f64,
}

impl PyProfile {
    fn rs(&self) -> CodecProfile {
        CodecProfile {
            spec: self.spec.clone(),
            bits_per_element: self.bits_per_element,
            encode_bytes_per_s: self.encode_bytes_per_s,
            decode_bytes_per_s: self.decode_bytes_per_s,
            decode_add_bytes_per_s: self.decode_add_bytes_per_s,
        }
    }
}

#[pymethods]
impl PyProfile {
    #[new]
    #[pyo3(signature = (spec, bits_per_element, encode_bytes_per_s=f64::INFINITY,
        decode_bytes_per_s=f64::INFINITY, decode_add_bytes_per_s=f64::INFINITY))]
    fn new(
        spec: String,
        bits_per_element: f64,
        encode_bytes_per_s: f64,
        decode_bytes_per_s: f64,
        decode_add_bytes_per_s: f64,
    ) -> PyResult<Self> {
        for (name, v) in [
            ("bits_per_element", bits_per_element),
            ("encode_bytes_per_s", encode_bytes_per_s),
            ("decode_bytes_per_s", decode_bytes_per_s),
            ("decode_add_bytes_per_s", decode_add_bytes_per_s),
        ] {
            if v.is_nan() || v <= 0.0 {
                return Err(PyValueError::new_err(format!(
                    "{name} must be positive, got {v}"
                )));
            }
        }
        Ok(PyProfile {
            spec,
            bits_per_element,
            encode_bytes_per_s,
            decode_bytes_per_s,
            decode_add_bytes_per_s,
        })
    }

    /// Compression ratio against float32.
    #[getter]
    fn ratio(&self) -> f64 {
        self.rs().ratio()
    }

    fn __repr__(&self) -> String {
        format!(
            "CodecProfile('{}', bits_per_element={:.4}, encode={:.3e} B/s, decode={:.3e} B/s, decode_add={:.3e} B/s)",
            self.spec,
            self.bits_per_element,
            self.encode_bytes_per_s,
            self.decode_bytes_per_s,
            self.decode_add_bytes_per_s
        )
    }
}

/// Measure ``codec``'s encode, decode and decode_add speed on this CPU on a
/// synthetic gradient of ``elements`` elements (best of repetitions for about
/// ``budget_s`` seconds); the result feeds :func:`allreduce_time`.
#[pyfunction]
#[pyo3(signature = (codec, elements=1 << 20, budget_s=0.2))]
fn calibrate(
    py: Python<'_>,
    codec: &Bound<'_, PyAny>,
    elements: usize,
    budget_s: f64,
) -> PyResult<PyProfile> {
    let spec = spec_of(codec)?;
    let p = py
        .detach(|| gradpack::sync::calibrate(&spec, elements, budget_s))
        .map_err(err)?;
    Ok(PyProfile {
        spec: p.spec,
        bits_per_element: p.bits_per_element,
        encode_bytes_per_s: p.encode_bytes_per_s,
        decode_bytes_per_s: p.decode_bytes_per_s,
        decode_add_bytes_per_s: p.decode_add_bytes_per_s,
    })
}

fn strategy(name: &str) -> PyResult<Strategy> {
    Strategy::from_name(name).ok_or_else(|| {
        PyValueError::new_err(format!(
            "strategy {name:?}: one of {}",
            quoted(Strategy::ALL.map(Strategy::name))
        ))
    })
}

/// `names` as `'a', 'b', 'c'` for an error message.
pub(crate) fn quoted<const N: usize>(names: [&str; N]) -> String {
    names.map(|n| format!("'{n}'")).join(", ")
}

fn check_cluster(nodes: u32, bandwidth: f64, latency: f64, elements: f64) -> PyResult<()> {
    if nodes == 0 {
        return Err(PyValueError::new_err("nodes must be at least 1"));
    }
    if bandwidth.is_nan() || bandwidth <= 0.0 {
        return Err(PyValueError::new_err(format!(
            "bandwidth must be positive bit/s, got {bandwidth}"
        )));
    }
    if latency.is_nan() || latency < 0.0 {
        return Err(PyValueError::new_err(format!(
            "latency must be >= 0 seconds, got {latency}"
        )));
    }
    if elements.is_nan() || elements < 0.0 {
        return Err(PyValueError::new_err(format!(
            "elements must be >= 0, got {elements}"
        )));
    }
    Ok(())
}

/// Modelled seconds to all-reduce `elements` float32 values on `nodes` ranks joined by
/// links of `bandwidth` bit/s and `latency` seconds per message, by `strategy`
/// (`'fp32-ring'`, `'ring'`, `'allgather'`, `'majority'`, `'twoshot'`) with `profile`'s codec
/// (the fp32 ring sums at `reduce_bytes_per_s`).
#[pyfunction]
#[pyo3(signature = (profile, strategy, nodes, bandwidth, elements, latency=0.0,
    reduce_bytes_per_s=f64::INFINITY))]
fn allreduce_time(
    profile: &PyProfile,
    strategy: &str,
    nodes: u32,
    bandwidth: f64,
    elements: f64,
    latency: f64,
    reduce_bytes_per_s: f64,
) -> PyResult<f64> {
    check_cluster(nodes, bandwidth, latency, elements)?;
    let s = self::strategy(strategy)?;
    Ok(cost::allreduce_cost(
        s,
        &profile.rs(),
        nodes,
        latency,
        elements,
        reduce_bytes_per_s,
    )
    .time(bandwidth))
}

/// The modelled time in seconds of the compressed ring all-reduce of `elements` on
/// `nodes` ranks whose chunks go as `pieces` frames each (a pipelined ring: a piece is
/// encoded while the one before it is on the link), on links of `bandwidth` bit/s and
/// `latency` s, with the speeds and bits of `profile`. With one piece it is
/// `allreduce_time(profile, "ring", ...)`.
#[pyfunction]
#[pyo3(signature = (profile, nodes, bandwidth, elements, latency=0.0, pieces=1))]
fn ring_time(
    profile: &PyProfile,
    nodes: u32,
    bandwidth: f64,
    elements: f64,
    latency: f64,
    pieces: u32,
) -> PyResult<f64> {
    check_cluster(nodes, bandwidth, latency, elements)?;
    if pieces == 0 {
        return Err(PyValueError::new_err("pieces must be at least 1"));
    }
    Ok(cost::pipelined_ring_time(
        &profile.rs(),
        nodes,
        latency,
        elements,
        pieces,
        bandwidth,
    ))
}

/// Modelled seconds of an all-reduce of `elements` float32 values on `nodes` nodes of
/// `per_node` ranks: links of `intra_bandwidth` bit/s (`intra_latency` s) inside a node,
/// and each node's uplink of `inter_bandwidth` (`inter_latency`), shared by its ranks'
/// streams. `hierarchical`: the two-level all-reduce (`node_bits` per element inside a
/// node: 32, or 16 for bf16), else the flat one, by `strategy` with `profile`'s codec.
#[pyfunction]
#[pyo3(signature = (profile, strategy, hierarchical, nodes, per_node, intra_bandwidth,
    inter_bandwidth, elements, intra_latency=0.0, inter_latency=0.0, node_bits=32.0,
    reduce_bytes_per_s=f64::INFINITY))]
#[allow(clippy::too_many_arguments)]
fn two_level_time(
    profile: &PyProfile,
    strategy: &str,
    hierarchical: bool,
    nodes: u32,
    per_node: u32,
    intra_bandwidth: f64,
    inter_bandwidth: f64,
    elements: f64,
    intra_latency: f64,
    inter_latency: f64,
    node_bits: f64,
    reduce_bytes_per_s: f64,
) -> PyResult<f64> {
    check_cluster(nodes, inter_bandwidth, inter_latency, elements)?;
    check_cluster(per_node, intra_bandwidth, intra_latency, elements)?;
    let s = self::strategy(strategy)?;
    let two = cost::TwoLevel {
        nodes,
        per_node,
        intra_bandwidth_bit_s: intra_bandwidth,
        intra_latency_s: intra_latency,
        inter_bandwidth_bit_s: inter_bandwidth,
        inter_latency_s: inter_latency,
    };
    Ok(if hierarchical {
        cost::hierarchical_time(
            s,
            &profile.rs(),
            &two,
            elements,
            node_bits,
            reduce_bytes_per_s,
        )
    } else {
        cost::flat_time(s, &profile.rs(), &two, elements, reduce_bytes_per_s)
    })
}

/// The fastest of the compressed ring, the two-shot (not for sparse codecs: top-k,
/// random-k, chunked top-k) and the all-gather for `profile`'s codec: returns
/// `(strategy name, modelled seconds)`.
#[pyfunction]
#[pyo3(signature = (profile, nodes, bandwidth, elements, latency=0.0,
    reduce_bytes_per_s=f64::INFINITY))]
fn best_strategy(
    profile: &PyProfile,
    nodes: u32,
    bandwidth: f64,
    elements: f64,
    latency: f64,
    reduce_bytes_per_s: f64,
) -> PyResult<(&'static str, f64)> {
    check_cluster(nodes, bandwidth, latency, elements)?;
    let cluster = cost::Cluster {
        nodes,
        bandwidth_bit_s: bandwidth,
        latency_s: latency,
    };
    let (s, t) = cost::best_strategy(&profile.rs(), &cluster, elements, reduce_bytes_per_s);
    Ok((s.name(), t))
}

/// The link bandwidth (bit/s) below which `profile`'s codec all-reduces faster than a
/// plain fp32 ring (infinite: always; 0: never).
#[pyfunction]
#[pyo3(signature = (profile, nodes, elements, latency=0.0, reduce_bytes_per_s=f64::INFINITY))]
fn break_even_bandwidth(
    profile: &PyProfile,
    nodes: u32,
    elements: f64,
    latency: f64,
    reduce_bytes_per_s: f64,
) -> PyResult<f64> {
    check_cluster(nodes, 1.0, latency, elements)?;
    Ok(cost::break_even_bandwidth(
        &profile.rs(),
        nodes,
        latency,
        elements,
        reduce_bytes_per_s,
    ))
}

/// Parse a bandwidth such as `'10Gbit/s'`, `'1.25GB/s'` or `'100Mbps'` into bit/s.
#[pyfunction]
fn parse_bandwidth(s: &str) -> PyResult<f64> {
    cost::parse_bandwidth(s).map_err(PyValueError::new_err)
}

/// Parse a duration such as `'50us'`, `'1.5ms'` or `'2s'` into seconds.
#[pyfunction]
fn parse_duration(s: &str) -> PyResult<f64> {
    cost::parse_duration(s).map_err(PyValueError::new_err)
}

/// The splitmix64 finaliser the crate derives every seed with.
#[pyfunction]
fn splitmix64(z: u64) -> u64 {
    gradpack::rng::splitmix64(z)
}

/// The seed rank `rank` encodes a tensor with at step `step`: splitmix64 of `base` mixed
/// with the step's and the tensor's `key`'s own splitmix64, then :func:`rank_seed` (what
/// :meth:`BucketGather.encode_run` derives for each part).
#[pyfunction]
fn tensor_seed(
    codec: &Bound<'_, PyAny>,
    base: u64,
    step: u64,
    key: u64,
    rank: usize,
) -> PyResult<u64> {
    Ok(gradpack::collective::tensor_seed(
        &spec_of(codec)?,
        base,
        step,
        key,
        rank,
    ))
}

/// The seed rank `rank` encodes with when a step's seed is `seed`: the same on every rank
/// for random-k (all ranks keep the same indices), else mixed with the rank.
#[pyfunction]
fn rank_seed(codec: &Bound<'_, PyAny>, seed: u64, rank: usize) -> PyResult<u64> {
    Ok(gradpack::collective::rank_seed(
        &spec_of(codec)?,
        seed,
        rank,
    ))
}

/// `(start, stop)` of chunk `c` when `n` elements are split into `p` chunks (sizes differ
/// by at most one, larger first), as the crate's collectives split them.
#[pyfunction]
fn chunk_range(n: usize, p: usize, c: usize) -> (usize, usize) {
    let r = gradpack::collective::chunk_range(n, p, c);
    (r.start, r.end)
}

/// The SIMD backend the kernels run on (`'avx512'`, `'avx2'`, `'neon'` or `'scalar'`).
#[pyfunction]
fn backend() -> &'static str {
    gradpack::Backend::current().name()
}

const OUTER_FORMAT: &str = "gradpack.OuterSync/1";

/// `f` on writable float32 views of `params` (each checked as `params[i]`).
fn on_params<R>(
    params: &[Bound<'_, PyAny>],
    f: impl FnOnce(&mut [&mut [f32]]) -> R,
) -> PyResult<R> {
    let mut arrays = params
        .iter()
        .enumerate()
        .map(|(i, x)| f32_out(x, &format!("params[{i}]")))
        .collect::<PyResult<Vec<_>>>()?;
    let mut views = arrays
        .iter_mut()
        .map(slice_out)
        .collect::<PyResult<Vec<_>>>()?;
    Ok(f(&mut views))
}

/// DiLoCo's outer synchronisation on rank ``rank`` of ``world`` (the Rust crate's
/// ``gradpack::outer::OuterSync``), over the same two message callables as
/// :class:`AllReduce` (or its ``transport``). :class:`gradpack.torch.DiLoCo` drives it
/// for a PyTorch model.
///
/// It keeps an outer copy of the tensors ``names`` of ``shapes`` in float32, starting
/// from ``params`` (the same on every rank). Call :meth:`step` after every inner
/// optimizer step. Every ``sync_every`` steps it all-reduces the mean of the
/// pseudo-gradients ``outer - local`` with ``codec`` (and error feedback: ``feedback``
/// ``"worker"``), takes a step of outer SGD (``outer_lr``, Nesterov ``outer_momentum``;
/// ``outer_momentum=0`` for none), and writes the new outer parameters into the
/// parameters: ``local = alpha * local + (1 - alpha) * outer``. With ``fragments`` P the
/// tensors are split into P fragments (in order, by size, or by ``assignment``) synced
/// at staggered steps; with ``delay`` tau each fragment's all-reduce starts tau steps
/// before its sync point and runs on a communication thread meanwhile. Every rank ends
/// each outer step with the same outer parameters, to the bit.
#[pyclass(module = "gradpack", name = "OuterSync")]
struct PyOuterSync {
    /// A mutex only so that the class is `Sync` (its receiver of the thread's answers is
    /// not); every method that uses it takes `&mut self` and reaches it with `get_mut`,
    /// or locks it for a read.
    inner: std::sync::Mutex<OuterSync<Net>>,
}

impl PyOuterSync {
    fn get(&mut self) -> &mut OuterSync<Net> {
        self.inner.get_mut().unwrap_or_else(|p| p.into_inner())
    }

    fn read(&self) -> std::sync::MutexGuard<'_, OuterSync<Net>> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[pymethods]
impl PyOuterSync {
    #[new]
    #[pyo3(signature = (
        names, shapes, params, rank=None, world=None, send=None, recv=None, *,
        sync_every=500, fragments=1,
        assignment=None, delay=0, alpha=0.0, outer_lr=0.7, outer_momentum=0.9,
        nesterov=true, codec=None, feedback="none", strategy="auto", pieces=1,
        checksum=true, seed=0, bandwidth=10e9, latency=10e-6, beta=1.0, gamma=1.0,
        residual="f32", allow_non_contractive=false, send_recv=None, transport=None,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        names: Vec<String>,
        shapes: Vec<Vec<usize>>,
        params: Vec<Bound<'_, PyAny>>,
        rank: Option<usize>,
        world: Option<usize>,
        send: Option<Py<PyAny>>,
        recv: Option<Py<PyAny>>,
        sync_every: u64,
        fragments: usize,
        assignment: Option<Vec<usize>>,
        delay: u64,
        alpha: f32,
        outer_lr: f32,
        outer_momentum: f32,
        nesterov: bool,
        codec: Option<&Bound<'_, PyAny>>,
        feedback: &str,
        strategy: &str,
        pieces: usize,
        checksum: bool,
        #[pyo3(from_py_with = seed_arg)] seed: u64,
        bandwidth: f64,
        latency: f64,
        beta: f32,
        gamma: f32,
        residual: &str,
        allow_non_contractive: bool,
        send_recv: Option<Py<PyAny>>,
        transport: Option<&Bound<'_, PyTcp>>,
    ) -> PyResult<Self> {
        let t = link(
            py,
            "OuterSync",
            rank,
            world,
            send,
            recv,
            send_recv,
            transport,
        )?;
        if names.len() != shapes.len() {
            return Err(PyValueError::new_err(format!(
                "{} names for {} shapes",
                names.len(),
                shapes.len()
            )));
        }
        let layout: Vec<Tensor> = names
            .iter()
            .zip(&shapes)
            .map(|(n, s)| Tensor::new(n.as_str(), s))
            .collect();
        let arrays = params
            .iter()
            .enumerate()
            .map(|(i, x)| f32_in(x, &format!("params[{i}]")))
            .collect::<PyResult<Vec<_>>>()?;
        let views = arrays.iter().map(slice_in).collect::<PyResult<Vec<_>>>()?;
        let opts = OuterOptions {
            sync_every,
            fragments,
            assignment,
            delay,
            alpha,
            outer_lr,
            outer_momentum,
            nesterov,
            codec: match codec {
                Some(c) => spec_of(c)?,
                None => CodecSpec::Identity(gradpack::Identity),
            },
            feedback: feedback_of(feedback)?,
            feedback_options: feedback_options(beta, gamma, residual, allow_non_contractive)?,
            strategy: strategy_choice(strategy, t.size(), bandwidth, latency)?,
            pieces,
            checksum,
            seed,
        };
        let inner = OuterSync::new(&layout, &views, t, opts).map_err(err)?;
        Ok(PyOuterSync {
            inner: std::sync::Mutex::new(inner),
        })
    }

    /// What the next `step` does: `(send, apply)`, the fragments whose pseudo-gradients
    /// it forms and those whose outer step it applies. Only their tensors are read or
    /// written.
    fn due(&self) -> (Vec<usize>, Vec<usize>) {
        let d = self.read().due();
        (d.send, d.apply)
    }

    /// Call after every inner step with the rank's parameters (float32 arrays, one per
    /// tensor; `None` when `due()` is empty). Returns `sent`, `applied`, `bytes_sent` and
    /// `messages` (those of the applied fragments).
    #[pyo3(signature = (params=None))]
    fn step<'py>(
        &mut self,
        py: Python<'py>,
        params: Option<Vec<Bound<'py, PyAny>>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let inner = self.get();
        let stats = match params {
            Some(params) => on_params(&params, |views| py.detach(|| inner.step(views)))?,
            None => {
                if !inner.due().is_empty() {
                    return Err(PyValueError::new_err(
                        "this step forms or applies an outer step: pass the parameters",
                    ));
                }
                py.detach(|| inner.step(&mut []))
            }
        }
        .map_err(err)?;
        let d = PyDict::new(py);
        d.set_item("sent", stats.sent)?;
        d.set_item("applied", stats.applied)?;
        d.set_item("bytes_sent", stats.bytes_sent)?;
        d.set_item("messages", stats.messages)?;
        Ok(d)
    }

    /// Move onto the transport of a new membership (the members that remain and those
    /// that join; the same arguments as the constructor's), keeping this member's state;
    /// then every member calls :meth:`heal`, and steps are refused until it has. A member
    /// that joins makes a new synchroniser and calls :meth:`heal` too. The former
    /// transport is closed. Nothing changes on an error.
    #[pyo3(signature = (rank=None, world=None, send=None, recv=None, *, send_recv=None, transport=None))]
    #[allow(clippy::too_many_arguments)]
    fn reform(
        &mut self,
        py: Python<'_>,
        rank: Option<usize>,
        world: Option<usize>,
        send: Option<Py<PyAny>>,
        recv: Option<Py<PyAny>>,
        send_recv: Option<Py<PyAny>>,
        transport: Option<&Bound<'_, PyTcp>>,
    ) -> PyResult<()> {
        let t = link(
            py,
            "OuterSync.reform",
            rank,
            world,
            send,
            recv,
            send_recv,
            transport,
        )?;
        let inner = self.get();
        let old = py.detach(|| inner.reform(t)).map_err(err)?;
        drop(old);
        Ok(())
    }

    /// Make the members' states one again after :meth:`reform` (a collective call of
    /// every member, with its parameters: float32 arrays, one per tensor). The member
    /// with the newest state sends it, bit for bit, to each member whose state differs
    /// (their parameters become the outer copy, their residuals zero), and every sync
    /// that failed runs again among the members that hold its pseudo-gradient. Returns
    /// `source`, `healed` (ranks), `was_healed`, `retried` (fragment and the members
    /// its mean is over), `dropped` (fragments no member could send), `applied` and
    /// `bytes_sent`.
    fn heal<'py>(
        &mut self,
        py: Python<'py>,
        params: Vec<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let inner = self.get();
        let h = on_params(&params, |views| py.detach(|| inner.heal(views)))?.map_err(err)?;
        let d = PyDict::new(py);
        d.set_item("source", h.source)?;
        d.set_item("healed", h.healed)?;
        d.set_item("was_healed", h.was_healed)?;
        d.set_item("retried", h.retried)?;
        d.set_item("dropped", h.dropped)?;
        d.set_item("applied", h.applied)?;
        d.set_item("bytes_sent", h.bytes_sent)?;
        Ok(d)
    }

    /// The tensors of every fragment, in layout order.
    #[getter]
    fn fragments(&self) -> Vec<Vec<usize>> {
        self.read().fragments()
    }

    /// Inner steps taken so far.
    #[getter]
    fn inner_step(&self) -> u64 {
        self.read().inner_step()
    }

    /// A copy of the outer parameters of tensor `i` (a flat float32 array).
    fn outer<'py>(&self, py: Python<'py>, i: usize) -> PyResult<Bound<'py, PyArray1<f32>>> {
        let inner = self.read();
        Ok(PyArray1::from_slice(py, inner.outer(i).map_err(err)?))
    }

    /// The state (step, outer copy, momentum, residuals, results not yet applied), to
    /// restore with `load_state_dict` into a synchroniser made with the same arguments
    /// on the same rank. Waits for the all-reduces in flight.
    fn state_dict<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let inner = self.get();
        let blob = py.detach(|| inner.save()).map_err(err)?;
        let step = inner.inner_step();
        let d = PyDict::new(py);
        d.set_item("format", OUTER_FORMAT)?;
        d.set_item("inner_step", step)?;
        d.set_item("blob", PyBytes::new(py, &blob))?;
        Ok(d)
    }

    /// Restore a state saved by `state_dict`; with the model of the same step, training
    /// continues bit for bit.
    fn load_state_dict(&mut self, py: Python<'_>, state: &Bound<'_, PyAny>) -> PyResult<()> {
        let blob = state_blob(state, "OuterSync", OUTER_FORMAT)?;
        let bytes = blob.as_bytes().to_vec();
        let inner = self.get();
        py.detach(|| inner.restore(&bytes)).map_err(err)
    }

    fn __repr__(&self) -> String {
        let inner = self.read();
        let o = inner.options();
        format!(
            "OuterSync('{}', sync_every={}, fragments={}, delay={}, step={})",
            o.codec,
            o.sync_every,
            o.fragments,
            o.delay,
            inner.inner_step()
        )
    }
}

const HIER_FORMAT: &str = "gradpack.Hierarchical/1";

/// The residuals of a two-level all-reduce's streams between nodes, as a dict.
fn hier_state<'py>(py: Python<'py>, h: &Hierarchical) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("format", HIER_FORMAT)?;
    let blobs: Vec<Bound<'py, PyBytes>> = h.save().iter().map(|b| PyBytes::new(py, b)).collect();
    d.set_item("streams", blobs)?;
    Ok(d)
}

/// Restore `hier_state`'s dict into `h`.
fn load_hier(h: &mut Hierarchical, state: &Bound<'_, PyAny>) -> PyResult<()> {
    let format: String = state_item(state, "Hierarchical", "format")?.extract()?;
    if format != HIER_FORMAT {
        return Err(PyValueError::new_err(format!(
            "Hierarchical state format {format:?}, expected {HIER_FORMAT:?}"
        )));
    }
    let blobs: Vec<Vec<u8>> = state_item(state, "Hierarchical", "streams")?.extract()?;
    h.restore(&blobs).map_err(err)
}

/// gradpack's two-level all-reduce (the Rust crate's
/// ``gradpack::collective::Hierarchical``) of one tensor of ``length`` elements on rank
/// ``rank`` of ``world``, over the same two message callables as :class:`AllReduce`
/// (or its ``transport``).
///
/// ``nodes`` gives the node of every rank (``0 .. N``). Inside a node the ranks
/// reduce-scatter the tensor in float32 (``node_codec="bf16"`` or ``"fp16"`` to halve
/// it), each node's ranks then all-reduce their shards between nodes with ``codec``
/// (``strategy``, ``feedback``, ``pieces`` as for :class:`AllReduce`; error feedback on
/// this leg only), side by side, and all-gather the result inside the node. Every rank
/// ends with the same bits; nodes may differ in size.
///
/// ``shared_memory`` (a name, as for :class:`AllReduce`) reduces inside a node through
/// shared memory, the node's ranks being one host's (``host`` to name them otherwise):
/// with the float32 node codec, in place in a stage of up to 4 MiB per rank (in rounds,
/// no frames: the same bits); with bf16 or fp16, by frames through shared-memory rings.
/// The legs between nodes use the callables. A :class:`SharedMemory` (made with a
/// ``stage`` for the reduction in place) shares its memory with other collectives.
#[pyclass(module = "gradpack", name = "Hierarchical")]
struct PyHierarchical {
    inner: Hierarchical,
    comm: Comm<Routed<Net>>,
}

#[pymethods]
impl PyHierarchical {
    #[new]
    #[pyo3(signature = (
        codec, length, rank=None, world=None, send=None, recv=None, nodes=None, *,
        node_codec=None, strategy="auto", op="mean", feedback="none", pieces=1,
        checksum=true, tag=0, bandwidth=10e9, latency=10e-6, beta=1.0, gamma=1.0,
        residual="f32", allow_non_contractive=false, shared_memory=None, host=None,
        shared_memory_timeout=300.0, send_recv=None, transport=None,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        codec: &Bound<'_, PyAny>,
        length: usize,
        rank: Option<usize>,
        world: Option<usize>,
        send: Option<Py<PyAny>>,
        recv: Option<Py<PyAny>>,
        nodes: Option<Vec<usize>>,
        node_codec: Option<&Bound<'_, PyAny>>,
        strategy: &str,
        op: &str,
        feedback: &str,
        pieces: usize,
        checksum: bool,
        tag: u32,
        bandwidth: f64,
        latency: f64,
        beta: f32,
        gamma: f32,
        residual: &str,
        allow_non_contractive: bool,
        shared_memory: Option<&Bound<'_, PyAny>>,
        host: Option<Vec<usize>>,
        shared_memory_timeout: f64,
        send_recv: Option<Py<PyAny>>,
        transport: Option<&Bound<'_, PyTcp>>,
    ) -> PyResult<Self> {
        let t = link(
            py,
            "Hierarchical",
            rank,
            world,
            send,
            recv,
            send_recv,
            transport,
        )?;
        let Some(nodes) = nodes else {
            return Err(PyTypeError::new_err(
                "Hierarchical needs nodes (the node of every rank)",
            ));
        };
        let (rank, world) = (t.rank(), t.size());
        if rank >= nodes.len() {
            return Err(PyValueError::new_err(format!(
                "rank {rank} is outside nodes ({} ranks)",
                nodes.len()
            )));
        }
        // Files of its own (a name) go by default among the ranks of this rank's node.
        let named = shared_memory.is_some_and(|s| !s.is_instance_of::<PySharedMemory>());
        let host = host.or_else(|| {
            named.then(|| {
                (0..nodes.len())
                    .filter(|&r| nodes[r] == nodes[rank])
                    .collect()
            })
        });
        let stage = stage_for(length, world);
        let t = routed(py, t, shared_memory, host, shared_memory_timeout, stage)?;
        let nodes = Nodes::new(nodes).map_err(err)?;
        let opts = AllReduceOptions {
            op: reduce_op(op)?,
            strategy: strategy_choice(strategy, nodes.count(), bandwidth, latency)?,
            feedback: feedback_of(feedback)?,
            feedback_options: feedback_options(beta, gamma, residual, allow_non_contractive)?,
            checksum,
            tag,
            pieces,
        };
        let node_codec = match node_codec {
            Some(c) => spec_of(c)?,
            None => CodecSpec::Identity(gradpack::Identity),
        };
        let inner =
            Hierarchical::new(spec_of(codec)?, node_codec, length, &t, nodes, opts).map_err(err)?;
        Ok(PyHierarchical {
            inner,
            comm: Comm::new(t),
        })
    }

    /// One all-reduce of `x` into `out`, or in place when `out` is None (as
    /// `AllReduce.run`).
    #[pyo3(signature = (x, out=None, seed=0))]
    fn run<'py>(
        &mut self,
        py: Python<'py>,
        x: &Bound<'py, PyAny>,
        out: Option<&Bound<'py, PyAny>>,
        #[pyo3(from_py_with = seed_arg)] seed: u64,
    ) -> PyResult<Bound<'py, PyDict>> {
        let (h, comm) = (&mut self.inner, &mut self.comm);
        run_collective(py, x, out, |xs, os| match xs {
            Some(xs) => h.run(comm, xs, os, seed),
            None => h.run_in_place(comm, os, seed),
        })
    }

    /// The strategy of the streams between nodes.
    #[getter]
    fn strategy(&self) -> &'static str {
        self.inner.strategy().name()
    }

    /// The codec between nodes.
    #[getter]
    fn codec(&self) -> PyCodec {
        PyCodec {
            spec: self.inner.codec(),
        }
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    /// The residuals of the streams between nodes.
    fn state_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        hier_state(py, &self.inner)
    }

    /// Restore a `state_dict`.
    fn load_state_dict(&mut self, state: &Bound<'_, PyAny>) -> PyResult<()> {
        load_hier(&mut self.inner, state)
    }

    fn __repr__(&self) -> String {
        format!(
            "Hierarchical(length={}, nodes={}, strategy='{}', rank={} of {})",
            self.inner.len(),
            self.inner.nodes().count(),
            self.inner.strategy().name(),
            self.comm.rank(),
            self.comm.size()
        )
    }
}

/// gradpack's codecs, frames, error feedback, collectives and cost model (the native part
/// of the `gradpack` Python package).
#[pymodule]
mod _native {
    #[pymodule_export]
    use super::{
        PyAllReduce, PyBucketGather, PyCodec, PyErrorFeedback, PyHierarchical, PyHookReducer,
        PyModelSelection, PyMomentum, PyNamedState, PyOuterSync, PyPowerSgd, PyPowerSgdByName,
        PyProfile, PySharedMemory, PyTcp, PyTensorGather, PyTuner, agree, allreduce_time, backend,
        best_strategy, break_even_bandwidth, calibrate, chunk_range, decode, decode_add,
        decode_into, default_strategy, encode, encode_into, frame_len, inspect, mean_over_ranks,
        measure_link, parse_bandwidth, parse_duration, powersgd_matrix, rank_seed, reduce_frames,
        ring_time, splitmix64, tensor_codec, tensor_seed, two_level_time, wants_feedback,
    };

    /// Size in bytes of every frame header.
    #[pymodule_export]
    const HEADER_LEN: usize = gradpack::HEADER_LEN;
}

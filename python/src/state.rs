//! The crate's per-tensor state for a front end's own buckets, kept by tensor name:
//! `TensorGather` (a bucket's all-gather with its residuals), `ModelSelection` (one top-k
//! over a whole model), `Momentum` (momentum correction) and `PowerSgdByName`.

use gradpack::sync::{
    HeldTensor, MatrixState, ModelSelection, Momentum, NamedState, PowerSgdByName, Tensor,
    TensorGather,
};
use numpy::PyArray1;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::{
    PyAllReduce, PyBucketGather, err, exchange_on, exchange_ranges, f32_in, f32_out, settings,
    slice_in, slice_out, spec_of, stats_dict,
};
use pyo3::exceptions::PyValueError;

/// One top-k over every compressed tensor of a step's buckets, in the model's order,
/// for a framework that reduces in buckets of its own (the PyTorch hook's
/// `selection="model"`).
///
/// `codec` is a `topk` codec; `feedback` keeps one error feedback over the selected
/// vector; `order` names the model's tensors in its order (a name not among them goes
/// after the named ones, in the order it comes). Tensors of fewer than `small_below`
/// elements, and vectors, go as float32 frames beside the selection (with `dct_2d` as
/// in `tensor_codec`). Residuals are kept by tensor name, so a regrouping of the buckets
/// carries each tensor's residual over.
#[pyclass(module = "gradpack", name = "ModelSelection")]
pub(crate) struct PyModelSelection {
    inner: ModelSelection,
}

#[pymethods]
impl PyModelSelection {
    #[new]
    #[pyo3(signature = (codec, order, *, feedback=true, small_below=0, dct_2d=false))]
    fn new(
        codec: &Bound<'_, PyAny>,
        order: Vec<String>,
        feedback: bool,
        small_below: usize,
        dct_2d: bool,
    ) -> PyResult<Self> {
        let c = spec_of(codec)?;
        let inner = ModelSelection::new(c, feedback, small_below, dct_2d, &order).map_err(err)?;
        Ok(PyModelSelection { inner })
    }

    /// Reduce a step's `buckets` together: each `(x, tensors)`, `x` a flat float32
    /// array and `tensors` its `(name, shape, key)` laid end to end (`key` seeds the
    /// tensor's frame when it goes as float32). Every rank passes its buckets of the same
    /// step, in any grouping and order. The message goes by `gather`; each `x` then holds
    /// its mean over the ranks. Seeds from `seed`, `step` and the rank; sealed with a
    /// payload CRC-32 when `checksum`. Returns the call's statistics.
    #[pyo3(signature = (gather, buckets, *, seed, step, checksum=false))]
    #[allow(clippy::type_complexity)]
    fn reduce<'py>(
        &mut self,
        py: Python<'py>,
        mut gather: PyRefMut<'py, PyBucketGather>,
        buckets: Vec<(Bound<'py, PyAny>, Vec<(String, Vec<usize>, u64)>)>,
        seed: u64,
        step: u64,
        checksum: bool,
    ) -> PyResult<Bound<'py, PyDict>> {
        let mut held = Vec::with_capacity(buckets.len());
        let mut arrays = Vec::with_capacity(buckets.len());
        for (i, (x, tensors)) in buckets.iter().enumerate() {
            arrays.push(f32_out(x, &format!("bucket {i}"))?);
            held.push(
                tensors
                    .iter()
                    .map(|(name, shape, key)| HeldTensor {
                        tensor: Tensor::new(name.as_str(), shape),
                        key: *key,
                    })
                    .collect::<Vec<_>>(),
            );
        }
        let mut slices = Vec::with_capacity(arrays.len());
        for (a, h) in arrays.iter_mut().zip(&held) {
            slices.push((slice_out(a)?, h.as_slice()));
        }
        let g = &mut *gather;
        let (inner, comm, send) = (&mut g.inner, &mut g.comm, &mut g.send);
        let sel = &mut self.inner;
        let stats = py
            .detach(|| sel.reduce(inner, comm, send, &mut slices, seed, step, checksum))
            .map_err(err)?;
        stats_dict(py, &stats)
    }

    /// Every tensor's residual by name (float32 copies).
    fn residuals<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        named_arrays(py, self.inner.residuals())
    }

    /// Replace every residual with `residuals` (name to float32 array), each taken up
    /// when its tensor next comes.
    fn restore(&mut self, residuals: &Bound<'_, PyDict>) -> PyResult<()> {
        self.inner.restore(named_vecs(residuals)?);
        Ok(())
    }

    fn __repr__(&self) -> String {
        format!("ModelSelection(codec='{}')", self.inner.codec())
    }
}

/// Momentum correction by tensor name, for a framework that regroups its buckets: each
/// rank keeps a float32 velocity per tensor, `u = momentum * u + g`, and sends it in
/// place of the gradient (give the optimizer no momentum of its own). The sync engine's
/// `momentum` option updates with the same arithmetic.
#[pyclass(module = "gradpack", name = "Momentum")]
pub(crate) struct PyMomentum {
    inner: Momentum,
}

#[pymethods]
impl PyMomentum {
    #[new]
    fn new(momentum: f32) -> PyResult<Self> {
        Ok(PyMomentum {
            inner: Momentum::new(momentum).map_err(err)?,
        })
    }

    /// One step on a bucket: `x` (flat float32) holds the gradients of `tensors`
    /// (`(name, shape)` each) laid end to end, and each is replaced by its tensor's new
    /// velocity (zero before a tensor's first step). With the GIL released.
    fn apply(
        &mut self,
        py: Python<'_>,
        x: &Bound<'_, PyAny>,
        tensors: Vec<(String, Vec<usize>)>,
    ) -> PyResult<()> {
        let ts: Vec<Tensor> = tensors
            .iter()
            .map(|(n, s)| Tensor::new(n.as_str(), s))
            .collect();
        let mut a = f32_out(x, "x")?;
        let xs = slice_out(&mut a)?;
        let m = &mut self.inner;
        py.detach(|| m.apply(&ts, xs)).map_err(err)
    }

    /// Every velocity by name (float32 copies).
    fn velocities<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        named_arrays(py, self.inner.velocities())
    }

    /// Replace every velocity with `velocities` (name to float32 array).
    fn restore(&mut self, velocities: &Bound<'_, PyDict>) -> PyResult<()> {
        self.inner.restore(named_vecs(velocities)?);
        Ok(())
    }

    fn __repr__(&self) -> String {
        format!("Momentum({})", self.inner.momentum())
    }
}

/// Whether a tensor sent with `codec` gets error feedback: never for `"identity"`;
/// `choice` when given; else exactly for `topk`, `chunktopk` and `sign`, which drop or
/// flatten so much of each step's gradient that training needs the residual back.
#[pyfunction]
#[pyo3(signature = (codec, choice=None))]
pub(crate) fn wants_feedback(codec: &Bound<'_, PyAny>, choice: Option<bool>) -> PyResult<bool> {
    Ok(gradpack::sync::wants_feedback(&spec_of(codec)?, choice))
}

/// The strategy a fixed `codec` runs by at `world` ranks when none is named:
/// `"fp32-ring"` for `"identity"`, `"ring"` from 3 ranks up for the quantisers (`fp16`,
/// `bf16`, `int8`, `qsgd`, `natural`, `ternary`, `fp8`, `fp4`, `codebook`), else
/// `"allgather"`.
#[pyfunction]
pub(crate) fn default_strategy(codec: &Bound<'_, PyAny>, world: usize) -> PyResult<&'static str> {
    Ok(gradpack::sync::default_strategy(&spec_of(codec)?, world).name())
}

/// A bucket's all-gather, each tensor with its own codec and its error feedback kept by
/// tensor name (so a regrouping of the buckets keeps each tensor's residual). Error
/// feedback as `wants_feedback(codec, feedback)` says.
#[pyclass(module = "gradpack", name = "TensorGather")]
pub(crate) struct PyTensorGather {
    inner: TensorGather,
}

#[pymethods]
impl PyTensorGather {
    #[new]
    #[pyo3(signature = (feedback=None))]
    fn new(feedback: Option<bool>) -> Self {
        PyTensorGather {
            inner: TensorGather::new(feedback),
        }
    }

    /// Reduce the bucket `x` (flat float32): `tensors` are its `(name, shape, key,
    /// codec)` laid end to end (`codec` `None`: left as it is). Each goes with its codec
    /// through its residual where error feedback is on, seeded from `seed`, `step`, its
    /// `key` and the rank; the frames go as one message by `gather`, and each tensor's
    /// mean over the ranks is written back. Returns the call's statistics.
    #[pyo3(signature = (gather, x, tensors, *, seed, step, checksum=false))]
    #[allow(clippy::type_complexity, clippy::too_many_arguments)]
    fn reduce<'py>(
        &mut self,
        py: Python<'py>,
        mut gather: PyRefMut<'py, PyBucketGather>,
        x: &Bound<'py, PyAny>,
        tensors: Vec<(String, Vec<usize>, u64, Option<Bound<'py, PyAny>>)>,
        seed: u64,
        step: u64,
        checksum: bool,
    ) -> PyResult<Bound<'py, PyDict>> {
        let mut held = Vec::with_capacity(tensors.len());
        for (name, shape, key, codec) in &tensors {
            let c = codec.as_ref().map(spec_of).transpose()?;
            let tensor = Tensor::new(name.as_str(), shape);
            held.push((HeldTensor { tensor, key: *key }, c));
        }
        let mut a = f32_out(x, "x")?;
        let xs = slice_out(&mut a)?;
        let g = &mut *gather;
        let (inner, comm, send) = (&mut g.inner, &mut g.comm, &mut g.send);
        let me = &mut self.inner;
        let stats = py
            .detach(|| me.reduce(inner, comm, send, xs, &held, seed, step, checksum))
            .map_err(err)?;
        stats_dict(py, &stats)
    }

    /// Every residual by name (float32 copies).
    fn residuals<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        named_arrays(py, self.inner.residuals())
    }

    /// Replace every residual with `residuals` (name to float32 array), each taken up
    /// when its tensor next goes with error feedback.
    fn restore(&mut self, residuals: &Bound<'_, PyDict>) -> PyResult<()> {
        self.inner.restore(named_vecs(residuals)?);
        Ok(())
    }

    fn __repr__(&self) -> String {
        "TensorGather()".into()
    }
}

/// `(name, values)` pairs as a dict of float32 arrays.
pub(crate) fn named_arrays(
    py: Python<'_>,
    all: Vec<(String, Vec<f32>)>,
) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    for (name, v) in all {
        d.set_item(name, PyArray1::from_vec(py, v))?;
    }
    Ok(d)
}

/// A dict of name to float32 array as `(name, values)` pairs.
pub(crate) fn named_vecs(d: &Bound<'_, PyDict>) -> PyResult<Vec<(String, Vec<f32>)>> {
    let mut all = Vec::with_capacity(d.len());
    for (k, v) in d.iter() {
        let name: String = k.extract()?;
        let a = f32_in(&v, &name)?;
        all.push((name, slice_in(&a)?.to_vec()));
    }
    Ok(all)
}

/// PowerSGD over a framework's own buckets: one `PowerSgdBucket` per set of matrix names,
/// each matrix's warm-start Q and residual following it by name when the buckets
/// regroup. The settings are `PowerSgdBucket`'s.
#[pyclass(module = "gradpack", name = "PowerSgdByName")]
pub(crate) struct PyPowerSgdByName {
    inner: PowerSgdByName,
}

#[pymethods]
impl PyPowerSgdByName {
    #[new]
    #[pyo3(signature = (rank=2, warm_start=true, feedback=true, min_compression=2.0))]
    fn new(rank: usize, warm_start: bool, feedback: bool, min_compression: f64) -> PyResult<Self> {
        let s = settings(rank, warm_start, feedback, min_compression);
        Ok(PyPowerSgdByName {
            inner: PowerSgdByName::new(s).map_err(err)?,
        })
    }

    /// A whole PowerSGD step on the bucket `m` (flat float32) whose matrices `names` are
    /// `shapes` (`(n, m, r)` each) at `offsets`: their bucket's state (made, and filled
    /// by name, when this set of names is new), then `PowerSgdBucket.exchange` with the
    /// seed the crate derives from `seed`, `step` and the names, the float32 ranges
    /// `plain` and the all-reduces `first` and `second`. Returns its flag (False: the
    /// factors were not finite).
    #[allow(clippy::too_many_arguments)]
    fn exchange(
        &mut self,
        py: Python<'_>,
        names: Vec<String>,
        shapes: Vec<(usize, usize, usize)>,
        offsets: Vec<usize>,
        m: &Bound<'_, PyAny>,
        seed: u64,
        step: u64,
        plain: Vec<(usize, usize)>,
        first: &Bound<'_, PyAllReduce>,
        second: &Bound<'_, PyAllReduce>,
    ) -> PyResult<bool> {
        let ranges = exchange_ranges(first, second, &plain)?;
        let seed = gradpack::sync::step_seed(seed, step, &names);
        if offsets.len() != shapes.len() {
            return Err(PyValueError::new_err(format!(
                "{} offsets for {} matrices",
                offsets.len(),
                shapes.len()
            )));
        }
        let placed: Vec<(usize, (usize, usize, usize))> = offsets.into_iter().zip(shapes).collect();
        let mut ma = f32_out(m, "m")?;
        let ms = slice_out(&mut ma)?;
        let len = ms.len();
        let me = &mut self.inner;
        exchange_on(py, ms, first, second, |m, f, g| {
            me.bucket(&names, &placed, len)?
                .exchange(m, seed, &ranges, f, g)
        })
    }

    /// Every matrix's state by name: `(q, residual)` float32 arrays (`q` None when
    /// unset).
    fn states<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        matrix_states(py, self.inner.states().map_err(err)?)
    }

    /// Replace every matrix's state with `states` (name to `(q or None, residual)`),
    /// each taken up when its bucket next forms.
    fn restore(&mut self, states: &Bound<'_, PyDict>) -> PyResult<()> {
        self.inner.restore(matrix_states_of(states)?);
        Ok(())
    }

    fn __repr__(&self) -> String {
        format!("PowerSgdByName(rank={})", self.inner.settings().rank)
    }
}

/// PowerSGD states by matrix name as a dict of `(q or None, residual)` float32 arrays.
fn matrix_states(py: Python<'_>, all: Vec<(String, MatrixState)>) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    for (name, (q, e)) in all {
        let q = q.map(|q| PyArray1::from_vec(py, q));
        d.set_item(name, (q, PyArray1::from_vec(py, e)))?;
    }
    Ok(d)
}

/// A dict of name to `(q or None, residual)` float32 arrays, all read.
fn matrix_states_of(states: &Bound<'_, PyDict>) -> PyResult<Vec<(String, MatrixState)>> {
    let mut all: Vec<(String, MatrixState)> = Vec::with_capacity(states.len());
    for (k, v) in states.iter() {
        let name: String = k.extract()?;
        let (q, e): (Option<Bound<'_, PyAny>>, Bound<'_, PyAny>) = v.extract()?;
        let q = match q {
            Some(q) => Some(slice_in(&f32_in(&q, &name)?)?.to_vec()),
            None => None,
        };
        let e = slice_in(&f32_in(&e, &name)?)?.to_vec();
        all.push((name, (q, e)));
    }
    Ok(all)
}

/// What a front end that forms its own buckets carries across steps, by tensor name, as
/// one saved blob that any front end reads (the crate's `sync::NamedState`; the PyTorch
/// hook's `state_dict` holds one): `settings` (`(key, value)` pairs), the `step`, the
/// error-feedback `residuals`, momentum's `velocities` and PowerSGD's `low_rank` state
/// (`(q or None, residual)`) by name, the saved `collectives` that run on a whole
/// bucket (by their tensors' names joined with `,`, a list of blobs each) and measured
/// auto's `plan` (a `Tuner` blob, or None).
#[pyclass(module = "gradpack", name = "NamedState", frozen)]
pub(crate) struct PyNamedState {
    pub(crate) inner: NamedState,
}

#[pymethods]
impl PyNamedState {
    #[new]
    #[pyo3(signature = (
        settings=Vec::new(), step=0, residuals=None, velocities=None, low_rank=None,
        collectives=None, plan=None,
    ))]
    fn new(
        settings: Vec<(String, String)>,
        step: u64,
        residuals: Option<&Bound<'_, PyDict>>,
        velocities: Option<&Bound<'_, PyDict>>,
        low_rank: Option<&Bound<'_, PyDict>>,
        collectives: Option<&Bound<'_, PyDict>>,
        plan: Option<Vec<u8>>,
    ) -> PyResult<Self> {
        let mut blobs = Vec::new();
        if let Some(c) = collectives {
            for (k, v) in c.iter() {
                blobs.push((k.extract::<String>()?, v.extract::<Vec<Vec<u8>>>()?));
            }
        }
        Ok(PyNamedState {
            inner: NamedState {
                settings,
                step,
                residuals: residuals.map(named_vecs).transpose()?.unwrap_or_default(),
                velocities: velocities.map(named_vecs).transpose()?.unwrap_or_default(),
                low_rank: low_rank
                    .map(matrix_states_of)
                    .transpose()?
                    .unwrap_or_default(),
                collectives: blobs,
                plan,
            },
        })
    }

    /// The state as one blob: versioned, with a CRC-32.
    fn save<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.inner.save())
    }

    /// Read a blob written by `save` (by any front end); a damaged one raises.
    #[staticmethod]
    fn load(blob: &[u8]) -> PyResult<Self> {
        Ok(PyNamedState {
            inner: NamedState::restore(blob).map_err(err)?,
        })
    }

    /// Raise unless the state was saved with each of `mine` (`(key, value)` pairs),
    /// naming the first that differs or is missing.
    fn check(&self, mine: Vec<(String, String)>) -> PyResult<()> {
        let pairs: Vec<(&str, &str)> = mine.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        self.inner.check(&pairs).map_err(err)
    }

    #[getter]
    fn settings(&self) -> Vec<(String, String)> {
        self.inner.settings.clone()
    }

    #[getter]
    fn step(&self) -> u64 {
        self.inner.step
    }

    #[getter]
    fn residuals<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        named_arrays(py, self.inner.residuals.clone())
    }

    #[getter]
    fn velocities<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        named_arrays(py, self.inner.velocities.clone())
    }

    #[getter]
    fn low_rank<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        matrix_states(py, self.inner.low_rank.clone())
    }

    #[getter]
    fn collectives<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (k, blobs) in &self.inner.collectives {
            let bs: Vec<Bound<'py, PyBytes>> = blobs.iter().map(|b| PyBytes::new(py, b)).collect();
            d.set_item(k, bs)?;
        }
        Ok(d)
    }

    #[getter]
    fn plan<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyBytes>> {
        self.inner.plan.as_ref().map(|p| PyBytes::new(py, p))
    }

    fn __repr__(&self) -> String {
        format!(
            "NamedState(step={}, residuals={}, velocities={}, low_rank={}, collectives={})",
            self.inner.step,
            self.inner.residuals.len(),
            self.inner.velocities.len(),
            self.inner.low_rank.len(),
            self.inner.collectives.len()
        )
    }
}

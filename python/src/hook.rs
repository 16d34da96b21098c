//! `gradpack._native.HookReducer`: the crate's `sync::BucketReducer` for the PyTorch
//! hook. The hook stages the bucket (device copies, dtype), hands it over once with the
//! GIL released, and completes DDP's future; the configuration of a step, the codec of
//! every tensor, the strategy, error feedback, PowerSGD and the one top-k over the model
//! are the crate's.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use gradpack::CodecSpec;
use gradpack::collective::{Routed, SharedMemory, Transport};
use gradpack::sync::{
    BucketReducer, Decision, HeldTensor, NamedState, ReducerOptions, Tensor, Way,
};
use numpy::{PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::net::{Net, PyTcp, link};
use crate::state::{PyNamedState, named_arrays, named_vecs};
use crate::tune::PyTuner;
use crate::{PySharedMemory, err, settings, slice_out, spec_of};

/// A bucket's tensor as the hook lays it out: name, shape, and the key its seed mixes in.
type Entry = (String, Vec<usize>, u64);

/// How a collective of the reducer reaches the other ranks: the arguments of
/// `gradpack.AllReduce`'s transport (`transport=`, or rank, world and the callables),
/// and the shared memory of this host's ranks (`host`) and of this host's ranks in this
/// rank's node (`node`, for the two-level all-reduce).
struct Link {
    rank: Option<usize>,
    world: Option<usize>,
    send: Option<Py<PyAny>>,
    recv: Option<Py<PyAny>>,
    send_recv: Option<Py<PyAny>>,
    transport: Option<Py<PyTcp>>,
    host: Option<Arc<SharedMemory>>,
    node: Option<Arc<SharedMemory>>,
}

impl Link {
    fn net(&self, py: Python<'_>) -> PyResult<Net> {
        let c = |f: &Option<Py<PyAny>>| f.as_ref().map(|f| f.clone_ref(py));
        let t = self.transport.as_ref().map(|t| t.bind(py).clone());
        link(
            py,
            "HookReducer",
            self.rank,
            self.world,
            c(&self.send),
            c(&self.recv),
            c(&self.send_recv),
            t.as_ref(),
        )
    }

    fn routed(&self, py: Python<'_>, node: bool) -> PyResult<Routed<Net>> {
        let shm = if node { &self.node } else { &self.host };
        Routed::sharing(self.net(py)?, shm.clone()).map_err(err)
    }
}

/// The PyTorch hook's reducer, the crate's `sync::BucketReducer`: it decides each
/// bucket's configuration (the float32 warm-up, the codec's default strategy, or
/// measured `auto`'s `Tuner`), each tensor's codec (small tensors and vectors as
/// float32, `dct_2d`), which matrices go as PowerSGD factors, and runs the bucket by the
/// crate's collectives with their error feedback: the all-gather per tensor (residuals
/// by tensor name), the ring, two-shot, majority vote or two-level all-reduce per bucket
/// layout, PowerSGD's exchange, or one top-k over the model (`selection="model"`). It
/// keeps that state and saves it by name.
///
/// `codec` is the fixed codec, or None for measured `auto` (the `Tuner` passed to each
/// call decides); `strategy` the strategy of a fixed codec (None: the crate's default
/// for the codec at the world's size). `feedback` forces error feedback on or off
/// (None: the crate's default per codec). `powersgd` is `(rank, warm_start, feedback,
/// min_compression, start_step)` or None; `selection` the model's tensor names in order
/// for one top-k over the model. Buckets of steps before `start_step` go as float32.
#[pyclass(module = "gradpack", name = "HookReducer", frozen)]
pub(crate) struct PyHookReducer {
    /// What `config` and `plain` read on the training thread, with no lock.
    opts: ReducerOptions,
    /// Locked by the communication thread's calls.
    inner: Mutex<BucketReducer<Routed<Net>>>,
}

fn tensors(layout: &[Entry]) -> Vec<Tensor> {
    layout
        .iter()
        .map(|(n, s, _)| Tensor::new(n.as_str(), s))
        .collect()
}

fn held(layout: &[Entry]) -> Vec<HeldTensor> {
    layout
        .iter()
        .map(|(name, shape, key)| HeldTensor {
            tensor: Tensor::new(name.as_str(), shape),
            key: *key,
        })
        .collect()
}

fn way(route: &str) -> PyResult<Way> {
    Way::from_name(route).ok_or_else(|| {
        PyValueError::new_err(format!(
            "route {route:?}: one of {}",
            crate::quoted(Way::ALL.map(Way::name))
        ))
    })
}

fn codec_or_mixed(codec: &str) -> PyResult<Option<CodecSpec>> {
    match codec {
        "mixed" => Ok(None),
        c => c.parse().map(Some).map_err(err),
    }
}

impl PyHookReducer {
    fn inner(&self) -> MutexGuard<'_, BucketReducer<Routed<Net>>> {
        // A panic while locked leaves a reducer whose calls each completed or failed whole.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn decide(
        &self,
        layout: &[Entry],
        codec: &str,
        route: &str,
        step: u64,
        tuner: Option<&PyTuner>,
    ) -> PyResult<Decision> {
        let (c, w) = (codec_or_mixed(codec)?, way(route)?);
        let ts = tensors(layout);
        match tuner {
            Some(t) => self.opts.decide(&ts, c, w, step, Some(&t.tuner())),
            None => self.opts.decide(&ts, c, w, step, None),
        }
        .map_err(err)
    }
}

#[pymethods]
impl PyHookReducer {
    #[new]
    #[pyo3(signature = (
        codec, *, strategy=None, feedback=None, seed=0, checksum=false, pieces=1,
        small_below=16384, dct_2d=false, start_step=0, node_codec="identity", powersgd=None,
        selection=None,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        codec: Option<&Bound<'_, PyAny>>,
        strategy: Option<&str>,
        feedback: Option<bool>,
        seed: u64,
        checksum: bool,
        pieces: usize,
        small_below: usize,
        dct_2d: bool,
        start_step: u64,
        node_codec: &str,
        powersgd: Option<(usize, bool, bool, f64, u64)>,
        selection: Option<Vec<String>>,
    ) -> PyResult<Self> {
        let opts = ReducerOptions {
            codec: codec.map(spec_of).transpose()?,
            way: strategy.map(way).transpose()?,
            feedback,
            seed,
            checksum,
            pieces,
            small_below,
            dct_2d,
            start_step,
            node_codec: node_codec.parse().map_err(err)?,
            powersgd: powersgd.map(|(rank, warm, fb, min_compression, start)| {
                (settings(rank, warm, fb, min_compression), start)
            }),
            selection,
        };
        let inner = BucketReducer::new(opts.clone()).map_err(err)?;
        Ok(PyHookReducer {
            opts,
            inner: Mutex::new(inner),
        })
    }

    /// The transport of the collectives to come (as `gradpack.AllReduce`'s), the shared
    /// memory of this host's ranks (`shared_memory`) and of this host's ranks in this
    /// rank's node (`node_memory`, for the two-level all-reduce, which needs `nodes`).
    /// Collectives made before are dropped.
    #[pyo3(signature = (
        rank=None, world=None, send=None, recv=None, *, send_recv=None, transport=None,
        shared_memory=None, node_memory=None, nodes=None,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn connect(
        &self,
        py: Python<'_>,
        rank: Option<usize>,
        world: Option<usize>,
        send: Option<Py<PyAny>>,
        recv: Option<Py<PyAny>>,
        send_recv: Option<Py<PyAny>>,
        transport: Option<Py<PyTcp>>,
        shared_memory: Option<PyRef<'_, PySharedMemory>>,
        node_memory: Option<PyRef<'_, PySharedMemory>>,
        nodes: Option<Vec<usize>>,
    ) -> PyResult<()> {
        let l = Link {
            rank,
            world,
            send,
            recv,
            send_recv,
            transport,
            host: shared_memory.map(|s| s.inner.clone()),
            node: node_memory.map(|s| s.inner.clone()),
        };
        let size = l.net(py)?.size(); // the arguments checked now
        // Collectives are made as their buckets first come, on the communication
        // thread with the GIL released: the callables' transport takes it to be made.
        let make = move |node: bool| {
            Python::attach(|py| l.routed(py, node)).map_err(|e| {
                gradpack::Error::Collective(format!("making a collective's transport: {e}"))
            })
        };
        self.inner()
            .connect(size, nodes, Box::new(make))
            .map_err(err)
    }

    /// Drop the transport and every collective made on it (the state stays: residuals,
    /// PowerSGD's and the rings' saved states); `connect` again before the next bucket.
    fn disconnect(&self) {
        self.inner().disconnect();
    }

    /// The configuration bucket `index` (its tensors `layout`, `(name, shape)` each)
    /// goes by at `step` on `world` ranks: `(codec spec or "mixed", route, trial)`.
    /// Route `"fp32"` is a float32 all-reduce of the whole bucket (the front end may run
    /// it on a transport of its own); `"powersgd"` sends the bucket's matrices as
    /// PowerSGD factors. `trial` is measured `auto`'s plan number while it is measured
    /// (record the bucket's time with `tuner.record`), else None. `staging` is bytes/s
    /// of a copy to the host and back, for a bucket on a device.
    #[pyo3(signature = (index, step, world, layout, staging=None, tuner=None))]
    #[allow(clippy::too_many_arguments)]
    fn config(
        &self,
        index: usize,
        step: u64,
        world: usize,
        layout: Vec<(String, Vec<usize>)>,
        staging: Option<f64>,
        tuner: Option<PyRef<'_, PyTuner>>,
    ) -> PyResult<(String, &'static str, Option<usize>)> {
        let ts: Vec<Tensor> = layout
            .iter()
            .map(|(n, s)| Tensor::new(n.as_str(), s))
            .collect();
        let turn = match &tuner {
            Some(t) => self
                .opts
                .config(index, step, world, &ts, staging, Some(&mut t.tuner())),
            None => self.opts.config(index, step, world, &ts, staging, None),
        }
        .map_err(err)?;
        let codec = turn
            .codec
            .map_or_else(|| "mixed".to_string(), |c| c.to_string());
        Ok((codec, turn.way.name(), turn.trial))
    }

    /// Whether a bucket of configuration `(codec, route)` is a float32 all-reduce of the
    /// whole bucket (stage a float64 bucket as it is, then).
    #[pyo3(signature = (layout, codec, route, step, tuner=None))]
    fn plain(
        &self,
        layout: Vec<Entry>,
        codec: &str,
        route: &str,
        step: u64,
        tuner: Option<PyRef<'_, PyTuner>>,
    ) -> PyResult<bool> {
        Ok(self
            .decide(&layout, codec, route, step, tuner.as_deref())?
            .plain())
    }

    /// Reduce the bucket `x` (flat; `layout` its tensors, `(name, shape, key)` each, laid
    /// end to end) of `step` by configuration `(codec, route)` from `config`, into its
    /// mean over the ranks, with the GIL released. Returns False, and leaves `x` as it
    /// is, when the bucket is a float32 all-reduce for the front end to run (a float64
    /// bucket's always is); a float32 `x` otherwise. Every rank calls it for the same
    /// buckets in the same order.
    #[pyo3(signature = (x, index, step, layout, codec, route, tuner=None))]
    #[allow(clippy::too_many_arguments)]
    fn reduce(
        &self,
        py: Python<'_>,
        x: &Bound<'_, PyAny>,
        index: u32,
        step: u64,
        layout: Vec<Entry>,
        codec: &str,
        route: &str,
        tuner: Option<PyRef<'_, PyTuner>>,
    ) -> PyResult<bool> {
        let d = self.decide(&layout, codec, route, step, tuner.as_deref())?;
        let f32_x = x
            .cast::<PyUntypedArray>()
            .is_ok_and(|a| a.dtype().is_equiv_to(&numpy::dtype::<f32>(py)));
        if d.plain() && !f32_x {
            return Ok(false);
        }
        let hs = held(&layout);
        let mut a = crate::f32_out(x, "x")?;
        let xs = slice_out(&mut a)?;
        let mut r = self.inner();
        let r = &mut *r;
        py.detach(|| r.run(xs, index, step, &hs, &d, true))
            .map_err(err)
    }

    /// `selection` over the model: a step's `buckets` (`(x, layout)` each, `x` flat
    /// float32) reduced together, one top-k over every compressed tensor in the model's
    /// order with its error feedback, the others as float32 frames, in one all-gather;
    /// each `x` then holds its mean over the ranks.
    fn reduce_model(
        &self,
        py: Python<'_>,
        buckets: Vec<(Bound<'_, PyAny>, Vec<Entry>)>,
        step: u64,
    ) -> PyResult<()> {
        let helds: Vec<Vec<HeldTensor>> = buckets.iter().map(|(_, l)| held(l)).collect();
        let mut arrays = Vec::with_capacity(buckets.len());
        for (i, (x, _)) in buckets.iter().enumerate() {
            arrays.push(crate::f32_out(x, &format!("bucket {i}"))?);
        }
        let mut slices = Vec::with_capacity(arrays.len());
        for (a, h) in arrays.iter_mut().zip(&helds) {
            slices.push((slice_out(a)?, h.as_slice()));
        }
        let mut r = self.inner();
        let r = &mut *r;
        py.detach(|| r.reduce_model(&mut slices, step)).map_err(err)
    }

    /// Every tensor's error-feedback residual by name (float32 copies).
    fn residuals<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        named_arrays(py, self.inner().residuals())
    }

    /// How many ring, two-shot, majority and two-level all-reduces are made now (one per
    /// bucket layout in use).
    #[getter]
    fn rings_made(&self) -> usize {
        self.inner().collectives_made()
    }

    /// Whether there is state to save by tensor name: a residual, a PowerSGD state, or a
    /// ring with error feedback.
    fn holds_state(&self) -> PyResult<bool> {
        self.inner().holds_state().map_err(err)
    }

    /// The state as the crate's named-state blob: `settings` (`(key, value)` pairs),
    /// `step`, momentum's `velocities` (name to float32 array) and measured auto's
    /// `plan` beside this reducer's residuals, PowerSGD state and rings.
    fn save_state<'py>(
        &self,
        py: Python<'py>,
        settings: Vec<(String, String)>,
        step: u64,
        velocities: &Bound<'py, PyDict>,
        plan: Option<Vec<u8>>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let mut state = NamedState {
            settings,
            step,
            velocities: named_vecs(velocities)?,
            plan,
            ..NamedState::default()
        };
        self.inner().save_into(&mut state).map_err(err)?;
        Ok(PyBytes::new(py, &state.save()))
    }

    /// Take up a `NamedState`'s residuals, PowerSGD state and rings, each used when its
    /// tensor or layout next comes; the collectives made so far are dropped. PowerSGD
    /// state for a reducer without PowerSGD is refused, changing nothing.
    fn restore_state(&self, state: PyRef<'_, PyNamedState>) -> PyResult<()> {
        self.inner().restore_from(&state.inner).map_err(err)
    }

    fn __repr__(&self) -> String {
        match self.opts.codec {
            Some(c) => format!("HookReducer(codec='{c}')"),
            None => "HookReducer(codec=None)".into(),
        }
    }
}

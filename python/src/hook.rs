//! `gradpack._native.HookReducer`: everything the PyTorch hook decides and runs for a
//! bucket, in one native object over the crate's collectives. The hook stages the
//! bucket (device copies, dtype), hands it over once with the GIL released, and
//! completes DDP's future; the configuration of a step, the codec of every tensor, the
//! strategy, error feedback, PowerSGD and the one top-k over the model are decided and
//! run here.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use gradpack::collective::{
    AllReduce, AllReduceOptions, BucketGather, Comm, Hierarchical, Nodes, ReduceOp, Routed,
    SharedMemory, StrategyChoice, Transport, tensor_seed,
};
use gradpack::cost::Strategy;
use gradpack::sync::{
    HeldTensor, ModelSelection, PowerSgd, PowerSgdByName, Tensor, TensorGather, default_strategy,
    step_seed, tensor_codec, wants_feedback,
};
use gradpack::{CodecSpec, Identity};
use numpy::{PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::net::{Net, PyTcp, link};
use crate::state::{low_rank_restore, low_rank_states, named_arrays, named_vecs};
use crate::tune::PyTuner;
use crate::{PySharedMemory, err, feedback_options, settings, slice_out, spec_of};

/// The all-gather's tag of the one top-k over the model (bucket indices are small).
const MODEL_TAG: u32 = u32::MAX;
/// PowerSGD's two float32 all-reduces of a bucket: their tags' high bits.
const P_KIND: u32 = 0x4000_0000;
const Q_KIND: u32 = 0x8000_0000;

/// A bucket's tensor as the hook lays it out: name, shape, and the key its seed mixes in.
type Entry = (String, Vec<usize>, u64);

/// How a collective of the reducer reaches the other ranks: the arguments of
/// `gradpack.AllReduce`'s transport (`transport=`, or rank, world and the callables).
struct Link {
    rank: Option<usize>,
    world: Option<usize>,
    send: Option<Py<PyAny>>,
    recv: Option<Py<PyAny>>,
    send_recv: Option<Py<PyAny>>,
    transport: Option<Py<PyTcp>>,
    /// Shared memory between the ranks of this host (every collective but the two-level
    /// one), and between the ranks of this host in this rank's node (the two-level one).
    host: Option<Arc<SharedMemory>>,
    node: Option<Arc<SharedMemory>>,
    nodes: Option<Vec<usize>>,
    /// The number of ranks.
    size: usize,
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

    /// A new collective's transport, through `shm` between the ranks of this host.
    fn routed(&self, py: Python<'_>, node: bool) -> PyResult<Routed<Net>> {
        let shm = if node { &self.node } else { &self.host };
        Routed::sharing(self.net(py)?, shm.clone()).map_err(err)
    }
}

/// A collective's own message stream.
struct Gather {
    inner: BucketGather,
    comm: Comm<Routed<Net>>,
    send: Vec<u8>,
}

enum Ring {
    Flat(AllReduce, Comm<Routed<Net>>),
    TwoLevel(Hierarchical, Comm<Routed<Net>>),
}

impl Ring {
    /// Its saved blobs (one for an all-reduce, one per stream for the two-level one).
    fn save(&self) -> Vec<Vec<u8>> {
        match self {
            Ring::Flat(a, _) => vec![a.save()],
            Ring::TwoLevel(h, _) => h.save(),
        }
    }

    fn codec(&self) -> CodecSpec {
        match self {
            Ring::Flat(a, _) => a.codec(),
            Ring::TwoLevel(h, _) => h.codec(),
        }
    }
}

/// One of PowerSGD's float32 all-reduces, with its message stream.
type FactorRing = (AllReduce, Comm<Routed<Net>>);

/// The layout of a bucket's ring: its tensors' names, elements, codec and strategy.
type RingKey = (String, usize, String, String);

/// What changes as the hook runs.
struct State {
    link: Option<Link>,
    gather: TensorGather,
    model: Option<ModelSelection>,
    low_rank: Option<PowerSgdByName>,
    gathers: HashMap<u32, Gather>,
    rings: HashMap<RingKey, Ring>,
    /// Bucket index to the key of its ring now (DDP regroups its buckets once).
    rings_now: HashMap<u32, RingKey>,
    /// Rings' saved blobs by their names, taken up when the layout comes.
    ring_saved: HashMap<String, Vec<Vec<u8>>>,
    /// PowerSGD's float32 all-reduces by (bucket, kind, length).
    factor_rings: HashMap<(u32, u32, usize), FactorRing>,
}

/// A bucket being reduced: DDP's index (the collectives' tag), the step and its tensors.
struct Bucket<'a> {
    index: u32,
    step: u64,
    layout: &'a [Entry],
}

/// How a bucket goes this time, decided before it is staged.
struct Decision {
    /// Each tensor's codec; `None` in a low-rank bucket for its matrices.
    codecs: Vec<CodecSpec>,
    /// (position, (n, m, r)) of the tensors sent as PowerSGD factors.
    low_rank: Vec<(usize, (usize, usize, usize))>,
    /// The whole bucket's codec, for a strategy that runs on the whole bucket.
    ring: Option<CodecSpec>,
    /// A float32 all-reduce of the whole bucket.
    plain: bool,
}

/// The strategies a fixed codec may be given.
const ROUTES: [&str; 5] = ["allgather", "ring", "twoshot", "hierarchical", "majority"];

const IDENTITY: CodecSpec = CodecSpec::Identity(Identity);

/// The PyTorch hook's reducer: it decides each bucket's configuration (the float32
/// warm-up, the codec's default strategy, or measured `auto`'s `Tuner`), each tensor's
/// codec (small tensors and vectors as float32, `dct_2d`), which matrices go as PowerSGD
/// factors, and runs the bucket by the crate's collectives with their error feedback:
/// the all-gather per tensor (residuals by tensor name), the ring, two-shot, majority
/// vote or two-level all-reduce per bucket layout, PowerSGD's exchange, or one top-k
/// over the model (`selection="model"`). It keeps that state and saves it by name.
///
/// `codec` is the fixed codec, or None for measured `auto` (the `Tuner` passed to each
/// call decides); `strategy` the strategy of a fixed codec (None: the crate's default
/// for the codec at the world's size). `feedback` forces error feedback on or off
/// (None: the crate's default per codec). `powersgd` is `(rank, warm_start, feedback,
/// min_compression, start_step)` or None; `selection` the model's tensor names in order
/// for one top-k over the model. Buckets of steps before `start_step` go as float32.
#[pyclass(module = "gradpack", name = "HookReducer", frozen)]
pub(crate) struct PyHookReducer {
    codec: Option<CodecSpec>,
    strategy: Option<&'static str>,
    feedback: Option<bool>,
    seed: u64,
    checksum: bool,
    pieces: usize,
    small_below: usize,
    dct_2d: bool,
    start_step: u64,
    node_codec: CodecSpec,
    powersgd: Option<(PowerSgd, u64)>,
    /// Locked by the communication thread's calls; the training thread's `config` reads
    /// only the settings above.
    state: Mutex<State>,
}

impl PyHookReducer {
    fn state(&self) -> MutexGuard<'_, State> {
        // A panic while locked leaves state whose calls each completed or failed whole.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The (position, (n, m, r)) of the tensors sent as PowerSGD factors at `step`.
    fn low_rank_of(&self, layout: &[Entry], step: u64) -> Vec<(usize, (usize, usize, usize))> {
        let Some((s, start)) = &self.powersgd else {
            return Vec::new();
        };
        if step < (*start).max(self.start_step) {
            return Vec::new();
        }
        layout
            .iter()
            .enumerate()
            .filter_map(|(i, (name, shape, _))| {
                s.matrix_of(&Tensor::new(name.as_str(), shape))
                    .map(|m| (i, m))
            })
            .collect()
    }

    fn decide(
        &self,
        layout: &[Entry],
        codec: &str,
        route: &str,
        step: u64,
        tuner: Option<&PyTuner>,
    ) -> PyResult<Decision> {
        let base: Option<CodecSpec> = if codec == "mixed" {
            None
        } else {
            Some(codec.parse().map_err(err)?)
        };
        let mut codecs = Vec::with_capacity(layout.len());
        for (name, shape, _) in layout {
            let b = match base {
                Some(b) => b,
                None => {
                    let t = tuner.ok_or_else(|| {
                        PyValueError::new_err("a 'mixed' configuration needs the tuner")
                    })?;
                    match t.choice_of(name) {
                        Some((_, "fp32")) => IDENTITY,
                        Some((spec, _)) => spec.parse().map_err(err)?,
                        None => {
                            return Err(PyValueError::new_err(format!(
                                "the tuner has no choice for {name:?}"
                            )));
                        }
                    }
                }
            };
            let t = Tensor::new(name.as_str(), shape);
            codecs.push(tensor_codec(&b, &t, self.small_below, self.dct_2d).map_err(err)?);
        }
        let low_rank = if route == "powersgd" {
            self.low_rank_of(layout, step)
        } else {
            Vec::new()
        };
        let ring = match (route, base) {
            ("ring" | "twoshot" | "hierarchical" | "majority", Some(b)) => {
                let n: usize = layout.iter().map(|e| e.1.iter().product::<usize>()).sum();
                let whole = Tensor::new("", &[n, 1]);
                Some(tensor_codec(&b, &whole, self.small_below, self.dct_2d).map_err(err)?)
            }
            ("ring" | "twoshot" | "hierarchical" | "majority", None) => {
                return Err(PyValueError::new_err(format!(
                    "route {route:?} runs one codec on the whole bucket, not 'mixed'"
                )));
            }
            _ => None,
        };
        let plain = low_rank.is_empty()
            && route != "hierarchical"
            && (route == "fp32" || codecs.iter().all(|c| *c == IDENTITY) || ring == Some(IDENTITY));
        Ok(Decision {
            codecs,
            low_rank,
            ring,
            plain,
        })
    }

    fn wants_ef(&self, c: &CodecSpec) -> bool {
        wants_feedback(c, self.feedback)
    }
}

/// The collective `index`'s all-gather (made on first use).
fn gather_of<'a>(
    py: Python<'_>,
    gathers: &'a mut HashMap<u32, Gather>,
    link: &Link,
    index: u32,
) -> PyResult<&'a mut Gather> {
    use std::collections::hash_map::Entry as Slot;
    Ok(match gathers.entry(index) {
        Slot::Occupied(o) => o.into_mut(),
        Slot::Vacant(v) => {
            let t = link.routed(py, false)?;
            let inner = BucketGather::new(&t, index, ReduceOp::Mean).map_err(err)?;
            v.insert(Gather {
                inner,
                comm: Comm::new(t),
                send: Vec::new(),
            })
        }
    })
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

fn not_connected() -> PyErr {
    PyRuntimeError::new_err("HookReducer: call connect before the first bucket")
}

#[pymethods]
impl PyHookReducer {
    #[new]
    #[pyo3(signature = (
        codec, *, strategy=None, feedback=None, seed=0, checksum=false,
        pieces=1, small_below=16384, dct_2d=false, start_step=0, node_codec="identity",
        powersgd=None, selection=None,
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
        let codec = codec.map(spec_of).transpose()?;
        let strategy = match strategy {
            None => None,
            Some(s) => Some(*ROUTES.iter().find(|r| **r == s).ok_or_else(|| {
                PyValueError::new_err(format!("strategy {s:?}: one of {}", crate::quoted(ROUTES)))
            })?),
        };
        if pieces == 0 {
            return Err(PyValueError::new_err("pieces must be at least 1"));
        }
        let powersgd = match powersgd {
            Some((rank, warm, fb, min_compression, start)) => {
                let s = settings(rank, warm, fb, min_compression);
                s.check().map_err(err)?;
                Some((s, start))
            }
            None => None,
        };
        let model = match selection {
            Some(order) => {
                let Some(c) = codec else {
                    return Err(PyValueError::new_err(
                        "selection over the model needs a fixed top-k codec",
                    ));
                };
                let fb = wants_feedback(&c, feedback);
                Some(ModelSelection::new(c, fb, small_below, dct_2d, &order).map_err(err)?)
            }
            None => None,
        };
        let low_rank = match &powersgd {
            Some((s, _)) => Some(PowerSgdByName::new(*s).map_err(err)?),
            None => None,
        };
        Ok(PyHookReducer {
            codec,
            strategy,
            feedback,
            seed,
            checksum,
            pieces,
            small_below,
            dct_2d,
            start_step,
            node_codec: node_codec.parse().map_err(err)?,
            powersgd,
            state: Mutex::new(State {
                link: None,
                gather: TensorGather::new(feedback),
                model,
                low_rank,
                gathers: HashMap::new(),
                rings: HashMap::new(),
                rings_now: HashMap::new(),
                ring_saved: HashMap::new(),
                factor_rings: HashMap::new(),
            }),
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
            nodes,
            size: 0,
        };
        let net = l.net(py)?; // checked now
        let l = Link {
            size: net.size(),
            ..l
        };
        if let Some(n) = &l.nodes
            && n.len() != net.size()
        {
            return Err(PyValueError::new_err(format!(
                "nodes lists {} ranks; the transport has {}",
                n.len(),
                net.size()
            )));
        }
        let mut st = self.state();
        st.gathers.clear();
        st.rings.clear();
        st.rings_now.clear();
        st.factor_rings.clear();
        st.link = Some(l);
        Ok(())
    }

    /// Drop the transport and every collective made on it (the state stays: residuals,
    /// PowerSGD's and the rings' saved states); `connect` again before the next bucket.
    fn disconnect(&self) {
        let mut st = self.state();
        for (k, r) in std::mem::take(&mut st.rings) {
            st.ring_saved.insert(k.0, r.save());
        }
        st.rings_now.clear();
        st.gathers.clear();
        st.factor_rings.clear();
        st.link = None;
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
    ) -> PyResult<(String, String, Option<usize>)> {
        let fp32 = || ("identity".to_string(), "fp32".to_string(), None);
        if world <= 1 || step < self.start_step {
            return Ok(fp32());
        }
        let entries: Vec<Entry> = layout.into_iter().map(|(n, s)| (n, s, 0)).collect();
        let low = !self.low_rank_of(&entries, step).is_empty();
        let (codec, route, trial) = match self.codec {
            None => {
                let t = tuner.ok_or_else(|| {
                    PyValueError::new_err("codec 'auto' (None) needs the tuner in config")
                })?;
                let l = entries.into_iter().map(|(n, s, _)| (n, s)).collect();
                let (c, r, trial) = t.next(index, l, staging)?;
                (c, r.to_string(), trial)
            }
            Some(c) if c == IDENTITY && !low => return Ok(fp32()),
            Some(c) => {
                let route = match self.strategy {
                    Some(s) => s,
                    None if c == IDENTITY => "fp32",
                    None => default_strategy(&c, world).name(),
                };
                (c.to_string(), route.to_string(), None)
            }
        };
        Ok(if low {
            (codec, "powersgd".into(), trial)
        } else {
            (codec, route, trial)
        })
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
            .plain)
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
        let mut guard = self.state();
        let st = &mut *guard;
        let link = st.link.as_ref().ok_or_else(not_connected)?;
        let world = link.size;
        if world <= 1 {
            return Ok(true);
        }
        let f32_x = x
            .cast::<PyUntypedArray>()
            .is_ok_and(|a| a.dtype().is_equiv_to(&numpy::dtype::<f32>(py)));
        // Two ranks under measured auto: float32 frames all-gathered and summed in rank
        // order move the ring's bytes and give a sum per tensor, whatever the grouping
        // (so a plan restored into a fresh model continues bit for bit).
        if d.plain && !(self.codec.is_none() && world == 2 && f32_x) {
            return Ok(false);
        }
        let mut a = crate::f32_out(x, "x")?;
        let xs = slice_out(&mut a)?;
        let n: usize = layout.iter().map(|e| e.1.iter().product::<usize>()).sum();
        if n != xs.len() {
            return Err(PyValueError::new_err(format!(
                "the layout holds {n} elements, the bucket {}",
                xs.len()
            )));
        }
        let b = Bucket {
            index,
            step,
            layout: &layout,
        };
        if !d.low_rank.is_empty() {
            self.powersgd(py, st, xs, &b, &d)?;
        } else if d.plain {
            self.all_gather(py, st, xs, &b, &vec![Some(IDENTITY); layout.len()])?;
        } else if let Some(ring) = d.ring {
            self.ring(py, st, xs, &b, ring, route)?;
        } else {
            let codecs: Vec<_> = d.codecs.iter().map(|c| Some(*c)).collect();
            self.all_gather(py, st, xs, &b, &codecs)?;
        }
        Ok(true)
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
        let mut guard = self.state();
        let st = &mut *guard;
        let link = st.link.as_ref().ok_or_else(not_connected)?;
        let Some(sel) = st.model.as_mut() else {
            return Err(PyValueError::new_err(
                "this reducer was made without selection over the model",
            ));
        };
        let helds: Vec<Vec<HeldTensor>> = buckets.iter().map(|(_, l)| held(l)).collect();
        let mut arrays = Vec::with_capacity(buckets.len());
        for (i, (x, _)) in buckets.iter().enumerate() {
            arrays.push(crate::f32_out(x, &format!("bucket {i}"))?);
        }
        let mut slices = Vec::with_capacity(arrays.len());
        for (a, h) in arrays.iter_mut().zip(&helds) {
            slices.push((slice_out(a)?, h.as_slice()));
        }
        let g = gather_of(py, &mut st.gathers, link, MODEL_TAG)?;
        let (seed, checksum) = (self.seed, self.checksum);
        let (inner, comm, send) = (&mut g.inner, &mut g.comm, &mut g.send);
        py.detach(|| sel.reduce(inner, comm, send, &mut slices, seed, step, checksum))
            .map_err(err)?;
        Ok(())
    }

    /// Every tensor's error-feedback residual by name (float32 copies).
    fn residuals<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let st = self.state();
        let mut all = st.gather.residuals();
        if let Some(m) = &st.model {
            all.extend(m.residuals());
        }
        named_arrays(py, all)
    }

    /// PowerSGD's state by matrix name: `(q or None, residual)` float32 arrays.
    fn low_rank<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        match &self.state().low_rank {
            Some(l) => low_rank_states(py, l),
            None => Ok(PyDict::new(py)),
        }
    }

    /// The saved blobs of every ring, two-shot, majority and two-level all-reduce by the
    /// names of its bucket's tensors joined with `,` (those of the layouts in use, and
    /// those restored and not used yet).
    fn rings<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let st = self.state();
        let d = PyDict::new(py);
        let put = |k: &str, blobs: Vec<Vec<u8>>| -> PyResult<()> {
            let bs: Vec<Bound<'py, PyBytes>> = blobs.iter().map(|b| PyBytes::new(py, b)).collect();
            d.set_item(k, bs)
        };
        for (k, v) in &st.ring_saved {
            put(k, v.clone())?;
        }
        for (k, r) in &st.rings {
            put(&k.0, r.save())?;
        }
        Ok(d)
    }

    /// How many ring, two-shot, majority and two-level all-reduces are made now (one per
    /// bucket layout in use).
    #[getter]
    fn rings_made(&self) -> usize {
        self.state().rings.len()
    }

    /// Whether there is state to save by tensor name: a residual, a PowerSGD state, or a
    /// ring with error feedback.
    fn holds_state(&self) -> PyResult<bool> {
        let st = self.state();
        let low = match &st.low_rank {
            Some(l) => !l.states().map_err(err)?.is_empty(),
            None => false,
        };
        Ok(low
            || st.rings.values().any(|r| self.wants_ef(&r.codec()))
            || !st.gather.residuals().is_empty()
            || st.model.as_ref().is_some_and(|m| !m.residuals().is_empty()))
    }

    /// Replace the state with a saved one: `residuals` (name to float32 array),
    /// `low_rank` (name to `(q or None, residual)`) and `rings` (names to a ring's blobs),
    /// each taken up when its tensor or layout next comes. The collectives made so far
    /// are dropped.
    fn restore(
        &self,
        residuals: &Bound<'_, PyDict>,
        low_rank: &Bound<'_, PyDict>,
        rings: &Bound<'_, PyDict>,
    ) -> PyResult<()> {
        let res = named_vecs(residuals)?;
        let mut saved = HashMap::new();
        for (k, v) in rings.iter() {
            saved.insert(k.extract::<String>()?, v.extract::<Vec<Vec<u8>>>()?);
        }
        let mut st = self.state();
        if let Some(l) = st.low_rank.as_mut() {
            low_rank_restore(l, low_rank)?;
        } else if !low_rank.is_empty() {
            return Err(PyValueError::new_err(
                "PowerSGD state given to a reducer without PowerSGD",
            ));
        }
        match st.model.as_mut() {
            Some(m) => m.restore(res),
            None => st.gather.restore(res),
        }
        st.rings.clear();
        st.rings_now.clear();
        st.gathers.clear();
        st.ring_saved = saved;
        Ok(())
    }

    fn __repr__(&self) -> String {
        match self.codec {
            Some(c) => format!("HookReducer(codec='{c}')"),
            None => "HookReducer(codec=None)".into(),
        }
    }
}

impl PyHookReducer {
    /// The bucket's tensors encoded (each with its codec, seed and residual),
    /// all-gathered and summed in rank order by collective `index`; a tensor whose codec
    /// is `None` is left as it is.
    fn all_gather(
        &self,
        py: Python<'_>,
        st: &mut State,
        xs: &mut [f32],
        b: &Bucket<'_>,
        codecs: &[Option<CodecSpec>],
    ) -> PyResult<()> {
        let link = st.link.as_ref().ok_or_else(not_connected)?;
        let tensors: Vec<(HeldTensor, Option<CodecSpec>)> = held(b.layout)
            .into_iter()
            .zip(codecs.iter().copied())
            .collect();
        let g = gather_of(py, &mut st.gathers, link, b.index)?;
        let (inner, comm, send) = (&mut g.inner, &mut g.comm, &mut g.send);
        let me = &mut st.gather;
        let (seed, step, checksum) = (self.seed, b.step, self.checksum);
        py.detach(|| me.reduce(inner, comm, send, xs, &tensors, seed, step, checksum))
            .map_err(err)?;
        Ok(())
    }

    /// The bucket's ring (or two-shot, majority, two-level all-reduce) of its layout,
    /// made on first use (with a saved state taken up), then run in place.
    fn ring(
        &self,
        py: Python<'_>,
        st: &mut State,
        xs: &mut [f32],
        b: &Bucket<'_>,
        codec: CodecSpec,
        route: &str,
    ) -> PyResult<()> {
        let (index, step, layout) = (b.index, b.step, b.layout);
        let link = st.link.as_ref().ok_or_else(not_connected)?;
        let names = layout
            .iter()
            .map(|e| e.0.as_str())
            .collect::<Vec<_>>()
            .join(",");
        let key: RingKey = (names.clone(), xs.len(), codec.to_string(), route.into());
        if !st.rings.contains_key(&key) {
            let opts = AllReduceOptions {
                op: ReduceOp::Mean,
                // The two-level all-reduce's streams between nodes by the cost model's
                // choice on a 10 Gbit/s, 10 us link (its default); the others as named.
                strategy: if route == "hierarchical" {
                    StrategyChoice::Auto {
                        bandwidth_bit_s: 10e9,
                        latency_s: 10e-6,
                        profile: None,
                    }
                } else {
                    StrategyChoice::Forced(crate::strategy(route)?)
                },
                feedback: if self.wants_ef(&codec) {
                    gradpack::collective::Feedback::WorkerAndOwner
                } else {
                    gradpack::collective::Feedback::None
                },
                feedback_options: feedback_options(1.0, 1.0, "f32", false)?,
                checksum: self.checksum,
                tag: index,
                pieces: if route == "majority" { 1 } else { self.pieces },
            };
            let mut ring = if route == "hierarchical" {
                let nodes = link.nodes.clone().ok_or_else(|| {
                    PyValueError::new_err("the two-level all-reduce needs nodes (connect)")
                })?;
                let t = link.routed(py, true)?;
                let nodes = Nodes::new(nodes).map_err(err)?;
                let h = Hierarchical::new(codec, self.node_codec, xs.len(), &t, nodes, opts)
                    .map_err(err)?;
                Ring::TwoLevel(h, Comm::new(t))
            } else {
                let t = link.routed(py, false)?;
                let a = AllReduce::new(codec, xs.len(), &t, opts).map_err(err)?;
                Ring::Flat(a, Comm::new(t))
            };
            if let Some(saved) = st.ring_saved.remove(&names) {
                match (&mut ring, saved.as_slice()) {
                    (Ring::Flat(a, _), [blob]) => a.restore(blob).map_err(err)?,
                    (Ring::TwoLevel(h, _), blobs) => h.restore(blobs).map_err(err)?,
                    (Ring::Flat(..), _) => {
                        return Err(PyValueError::new_err(format!(
                            "the saved all-reduce of {names:?} has {} blobs, not 1",
                            saved.len()
                        )));
                    }
                }
            }
            st.rings.insert(key.clone(), ring);
        }
        if let Some(old) = st.rings_now.insert(index, key.clone())
            && old != key
        {
            st.rings.remove(&old); // DDP regrouped its buckets: that layout is gone
        }
        // The crate mixes the rank into the seed itself: the same base on every rank.
        let seed = tensor_seed(&codec, self.seed, step, u64::from(index), 0);
        let ring = st.rings.get_mut(&key).expect("made above");
        py.detach(|| match ring {
            Ring::Flat(a, c) => a.run_in_place(c, xs, seed),
            Ring::TwoLevel(h, c) => h.run_in_place(c, xs, seed),
        })
        .map_err(err)?;
        Ok(())
    }

    /// A bucket whose matrices go as PowerSGD factors: the crate's whole step (their `P`
    /// in one float32 all-reduce with the bucket's float32 tensors, their `Q` in a
    /// second), then the tensors of other codecs by the all-gather.
    fn powersgd(
        &self,
        py: Python<'_>,
        st: &mut State,
        xs: &mut [f32],
        b: &Bucket<'_>,
        d: &Decision,
    ) -> PyResult<()> {
        let (index, step, layout) = (b.index, b.step, b.layout);
        let link = st.link.as_ref().ok_or_else(not_connected)?;
        let mut starts = Vec::with_capacity(layout.len());
        let mut at = 0usize;
        for e in layout {
            starts.push(at);
            at += e.1.iter().product::<usize>();
        }
        let lr: Vec<usize> = d.low_rank.iter().map(|&(i, _)| i).collect();
        let is_lr = |i: usize| lr.contains(&i);
        let names: Vec<String> = lr.iter().map(|&i| layout[i].0.clone()).collect();
        let placed: Vec<(usize, (usize, usize, usize))> =
            d.low_rank.iter().map(|&(i, m)| (starts[i], m)).collect();
        let plain: Vec<core::ops::Range<usize>> = (0..layout.len())
            .filter(|&i| !is_lr(i) && d.codecs[i] == IDENTITY)
            .map(|i| starts[i]..starts[i] + layout[i].1.iter().product::<usize>())
            .collect();
        let p_len: usize = d.low_rank.iter().map(|(_, (n, _, r))| n * r).sum();
        let q_len: usize = d.low_rank.iter().map(|(_, (_, m, r))| m * r).sum();
        let p_len = p_len + plain.iter().map(|r| r.len()).sum::<usize>();
        for (kind, len) in [(P_KIND, p_len), (Q_KIND, q_len)] {
            let key = (index, kind, len);
            if !st.factor_rings.contains_key(&key) {
                let t = link.routed(py, false)?;
                let opts = AllReduceOptions {
                    op: ReduceOp::Mean,
                    strategy: StrategyChoice::Forced(Strategy::Fp32Ring),
                    feedback: gradpack::collective::Feedback::None,
                    feedback_options: feedback_options(1.0, 1.0, "f32", false)?,
                    checksum: self.checksum,
                    tag: kind | (index & 0x3FFF_FFFF),
                    pieces: self.pieces,
                };
                let a = AllReduce::new(IDENTITY, len, &t, opts).map_err(err)?;
                // The bucket's other length of this kind is gone.
                st.factor_rings.retain(|k, _| (k.0, k.1) != (index, kind));
                st.factor_rings.insert(key, (a, Comm::new(t)));
            }
        }
        let seed = step_seed(self.seed, step, &names);
        let len = xs.len();
        let lrs = st
            .low_rank
            .as_mut()
            .expect("a low-rank decision needs PowerSGD");
        let mut first = st
            .factor_rings
            .remove(&(index, P_KIND, p_len))
            .expect("made above");
        let second = st.factor_rings.get_mut(&(index, Q_KIND, q_len));
        let second = second.expect("made above");
        let out = py.detach(|| {
            lrs.bucket(&names, &placed, len)?.exchange(
                xs,
                seed,
                &plain,
                (&mut first.0, &mut first.1),
                (&mut second.0, &mut second.1),
            )
        });
        st.factor_rings.insert((index, P_KIND, p_len), first);
        out.map_err(err)?;
        let rest: Vec<Option<CodecSpec>> = (0..layout.len())
            .map(|i| (!is_lr(i) && d.codecs[i] != IDENTITY).then_some(d.codecs[i]))
            .collect();
        if rest.iter().any(Option::is_some) {
            self.all_gather(py, st, xs, b, &rest)?;
        }
        Ok(())
    }
}

//! `gradpack.Tuner`: the crate's measured `auto` (`gradpack::sync::Tuner`).

use gradpack::CodecSpec;
use gradpack::collective::{Comm, Nodes};
use gradpack::sync::{
    BucketConfig, Network, Route, Tensor, TuneOptions, Tuner, tensor_codec as codec_of,
};
use std::sync::{Mutex, MutexGuard, PoisonError};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::net::{PyTcp, link};
use crate::{PyProfile, err};

/// Measured `auto`: per bucket, float32 and the configurations (codec and route) the
/// cost model ranks fastest, measured in turn on the real bucket; every rank keeps the
/// one with the smallest mean of the ranks' best times, float32 on a tie, so none
/// measured slower than float32 is ever kept.
///
/// `profiles` are the measured speeds of every candidate and of `"identity"` (every rank
/// passes the same: average them over the ranks). `routes` are those tried besides
/// float32: `"allgather"`, `"ring"`, `"twoshot"`, `"hierarchical"` (which needs `nodes`, the node of
/// every rank). `bandwidth` (bit/s) and `latency` (s) are the link between ranks (between
/// nodes, with `nodes`); `intra_bandwidth` and `intra_latency` the link inside a node.
/// Tensors of fewer than `small_below` elements, and vectors, go as float32 by the
/// all-gather; `dct_2d` sends a `dct` codec of `width=0` in tiles of each matrix's rows.
/// `trials` configurations are measured besides float32, `trial_steps` steps each.
#[pyclass(module = "gradpack", name = "Tuner", frozen)]
pub(crate) struct PyTuner {
    /// Locked for each call, and not while the ranks share their times (the hook's
    /// training thread asks for configurations while its communication thread records).
    inner: Mutex<Tuner>,
}

impl PyTuner {
    pub(crate) fn tuner(&self) -> MutexGuard<'_, Tuner> {
        // A panic while locked leaves a tuner whose calls each completed or failed whole.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A layout given as `(name, shape)` pairs.
fn tensors(layout: Vec<(String, Vec<usize>)>) -> Vec<Tensor> {
    layout
        .into_iter()
        .map(|(name, shape)| Tensor { name, shape })
        .collect()
}

fn route(name: &str) -> PyResult<Route> {
    Route::from_name(name).ok_or_else(|| {
        PyValueError::new_err(format!(
            "route {name:?}: one of {}",
            crate::quoted(Route::ALL.map(Route::name))
        ))
    })
}

/// A configuration as `(codec spec or "mixed", route)`.
fn pair(c: &BucketConfig) -> (String, &'static str) {
    (c.codec_name(), c.route.name())
}

#[pymethods]
impl PyTuner {
    #[new]
    #[pyo3(signature = (
        world, profiles, candidates, *, routes=vec!["allgather".to_string(), "ring".to_string(), "twoshot".to_string()],
        bandwidth, latency=50e-6, intra_bandwidth=40e9, intra_latency=5e-6, nodes=None,
        small_below=16384, dct_2d=false, trials=2, trial_steps=2,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        world: usize,
        profiles: Vec<PyRef<'_, PyProfile>>,
        candidates: Vec<String>,
        routes: Vec<String>,
        bandwidth: f64,
        latency: f64,
        intra_bandwidth: f64,
        intra_latency: f64,
        nodes: Option<Vec<usize>>,
        small_below: usize,
        dct_2d: bool,
        trials: usize,
        trial_steps: usize,
    ) -> PyResult<Self> {
        let opts = TuneOptions {
            candidates: candidates
                .iter()
                .map(|c| spec(c))
                .collect::<PyResult<_>>()?,
            routes: routes.iter().map(|r| route(r)).collect::<PyResult<_>>()?,
            network: Network {
                bandwidth_bit_s: bandwidth,
                latency_s: latency,
            },
            node_network: Network {
                bandwidth_bit_s: intra_bandwidth,
                latency_s: intra_latency,
            },
            nodes: nodes.map(Nodes::new).transpose().map_err(err)?,
            small_below,
            dct_2d,
            trials,
            trial_steps,
        };
        let profiles = profiles.iter().map(|p| p.rs()).collect();
        Ok(PyTuner {
            inner: Mutex::new(Tuner::new(world, opts, profiles).map_err(err)?),
        })
    }

    /// The configuration bucket `bucket` (a list of `(name, shape)` of its tensors, in
    /// order) goes by this step: `(codec spec or "mixed", route, trial)`, `trial` being
    /// the plan's number to pass to :meth:`record` with the time, or `None` once the
    /// plan is decided. `staging`: bytes/s of a copy to the host and back, for a bucket
    /// that lives on a device.
    #[pyo3(signature = (bucket, layout, staging=None))]
    pub(crate) fn next(
        &self,
        bucket: usize,
        layout: Vec<(String, Vec<usize>)>,
        staging: Option<f64>,
    ) -> PyResult<(String, &'static str, Option<usize>)> {
        let turn = self
            .tuner()
            .next(bucket, &tensors(layout), staging)
            .map_err(err)?;
        let (codec, route) = pair(&turn.config);
        Ok((codec, route, turn.trial))
    }

    /// Record `seconds`, the time of a trial of plan `trial`. After the plan's last
    /// trial this is a collective on the transport given (as for :func:`gradpack.agree`):
    /// the ranks share their times and keep the fastest configuration. Returns whether
    /// the plan is decided now.
    #[pyo3(signature = (
        trial, seconds, rank=None, world=None, send=None, recv=None, *, tag=u32::MAX - 1,
        send_recv=None, transport=None,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn record(
        &self,
        py: Python<'_>,
        trial: usize,
        seconds: f64,
        rank: Option<usize>,
        world: Option<usize>,
        send: Option<Py<PyAny>>,
        recv: Option<Py<PyAny>>,
        tag: u32,
        send_recv: Option<Py<PyAny>>,
        transport: Option<&Bound<'_, PyTcp>>,
    ) -> PyResult<bool> {
        let t = link(
            py,
            "Tuner.record",
            rank,
            world,
            send,
            recv,
            send_recv,
            transport,
        )?;
        let Some(times) = self.tuner().note(trial, seconds).map_err(err)? else {
            return Ok(false);
        };
        let mut comm = Comm::new(t);
        let shared = py.detach(|| Tuner::share(&mut comm, tag, &times));
        let means = shared.map_err(|e| {
            self.tuner().restart(trial); // measured again, as on every other rank
            err(e)
        })?;
        self.tuner().decide(trial, &means).map_err(err)?;
        Ok(true)
    }

    /// Measure plan `trial` again from its first configuration, forgetting its times:
    /// call it on every rank when a trial's reduction failed (a failed sharing of the
    /// times restarts its plan by itself).
    fn restart(&self, trial: usize) {
        self.tuner().restart(trial);
    }

    /// Whether every bucket's plan (as of its last :meth:`next`) is decided.
    fn decided(&self) -> bool {
        self.tuner().decided()
    }

    /// The configuration decided for the tensor `name`: `(codec spec, route)`, or
    /// `None`.
    pub(crate) fn choice_of(&self, name: &str) -> Option<(String, &'static str)> {
        self.tuner().choice_of(name).map(pair)
    }

    /// The cost model's time (s) of an all-reduce of `elements` elements with `codec`
    /// by `route`.
    fn time(&self, codec: &str, route: &str, elements: usize) -> PyResult<f64> {
        self.tuner()
            .time(&spec(codec)?, self::route(route)?, elements)
            .map_err(err)
    }

    /// The modelled time (s) of a bucket (`(name, shape)` of each tensor) with `codec`
    /// by `route`, plus the copies to the host and back at `staging` bytes/s if given.
    #[pyo3(signature = (codec, route, layout, staging=None))]
    fn modelled(
        &self,
        codec: &str,
        route: &str,
        layout: Vec<(String, Vec<usize>)>,
        staging: Option<f64>,
    ) -> PyResult<f64> {
        self.tuner()
            .modelled(
                &spec(codec)?,
                self::route(route)?,
                &tensors(layout),
                staging,
            )
            .map_err(err)
    }

    /// The candidate the model ranks fastest for a tensor of `elements` elements.
    fn modelled_best(&self, elements: usize) -> PyResult<String> {
        Ok(self
            .tuner()
            .modelled_best(elements)
            .map_err(err)?
            .to_string())
    }

    /// The plan of the buckets as of their last :meth:`next`: one dict per bucket and
    /// configuration tried, with ``bucket``, ``tensors``, ``elements``, ``codec``
    /// (``"float32"`` for the float32 all-reduce), ``strategy`` (``"all-reduce"`` for
    /// it), ``modelled_ms``, ``measured_ms`` (the mean of the ranks' best; ``None``
    /// until measured) and ``chosen``.
    fn plan<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let ms = |v: Option<f64>| v.map(|s| 1e3 * s);
        self.tuner()
            .plan()
            .into_iter()
            .map(|r| {
                let d = PyDict::new(py);
                let fp32 = r.config.route == Route::Fp32;
                d.set_item("bucket", r.bucket)?;
                d.set_item("tensors", r.tensors)?;
                d.set_item("elements", r.elements)?;
                let codec = if fp32 {
                    "float32".into()
                } else {
                    r.config.codec_name()
                };
                d.set_item("codec", codec)?;
                let strategy = if fp32 {
                    "all-reduce"
                } else {
                    r.config.route.name()
                };
                d.set_item("strategy", strategy)?;
                d.set_item("modelled_ms", ms(r.modelled_s))?;
                d.set_item("measured_ms", ms(r.measured_s))?;
                d.set_item("chosen", r.chosen)?;
                Ok(d)
            })
            .collect()
    }

    /// :meth:`plan` as a text table, the chosen rows marked with ``*``.
    fn table(&self) -> String {
        self.tuner().table()
    }

    /// The decided plans and each tensor's choice, as the crate's versioned,
    /// checksummed blob.
    fn save<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.tuner().save())
    }

    /// Restore a :meth:`save` (a damaged blob raises and changes nothing).
    fn restore(&self, blob: &[u8]) -> PyResult<()> {
        self.tuner().restore(blob).map_err(err)
    }
}

fn spec(s: &str) -> PyResult<CodecSpec> {
    s.parse().map_err(err)
}

/// The spec of the codec a tensor of `shape` is sent with when its bucket's codec is
/// `codec`: float32 (``"identity"``) for tensors of fewer than `small_below` elements
/// and for vectors; with `dct_2d`, a `dct` codec of `width=0` with each matrix's row
/// length as its width (2-D tiles).
#[pyfunction]
#[pyo3(signature = (codec, shape, small_below=16384, dct_2d=false))]
pub(crate) fn tensor_codec(
    codec: &str,
    shape: Vec<usize>,
    small_below: usize,
    dct_2d: bool,
) -> PyResult<String> {
    let t = Tensor {
        name: String::new(),
        shape,
    };
    Ok(codec_of(&spec(codec)?, &t, small_below, dct_2d)
        .map_err(err)?
        .to_string())
}

/// The mean over the ranks of each rank's `values` (every rank passes as many): each
/// rank's values sent to every other and summed in rank order, so every rank gets the
/// same bits (as the tuner shares its times). A collective on the transport given.
#[pyfunction]
#[pyo3(signature = (
    values, rank=None, world=None, send=None, recv=None, *, tag=u32::MAX - 3, send_recv=None,
    transport=None,
))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn mean_over_ranks(
    py: Python<'_>,
    values: Vec<f64>,
    rank: Option<usize>,
    world: Option<usize>,
    send: Option<Py<PyAny>>,
    recv: Option<Py<PyAny>>,
    tag: u32,
    send_recv: Option<Py<PyAny>>,
    transport: Option<&Bound<'_, PyTcp>>,
) -> PyResult<Vec<f64>> {
    let t = link(
        py,
        "mean_over_ranks",
        rank,
        world,
        send,
        recv,
        send_recv,
        transport,
    )?;
    let mut comm = Comm::new(t);
    py.detach(|| Tuner::share(&mut comm, tag, &values))
        .map_err(err)
}

//! The native transport between hosts (`gradpack.Tcp`) and what the collectives take as
//! their transport: the crate's TCP transport, shared by every collective of a rank made
//! with it, or the two Python callables of `PyTransport`.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, ToSocketAddrs, UdpSocket};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gradpack::collective::{Shared, Tcp, TcpOptions, Transport, draw_token, named_interface};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::{err, py_transport};

/// What a collective of the Python package sends its messages through: the crate's TCP
/// transport of a `gradpack.Tcp`, shared by every collective made with it (no message
/// touches Python), or the caller's `send`/`recv` callables (the GIL taken around each
/// call), one collective's own.
pub(crate) type Net = Shared<dyn Transport + Send>;

/// `t` as a [`Net`].
fn net(t: impl Transport + Send + 'static) -> Net {
    let shared: Arc<Mutex<dyn Transport + Send>> = Arc::new(Mutex::new(t));
    Shared::from(shared)
}

/// The transport of a new collective: `transport` (a `gradpack.Tcp`) when given, else the
/// callables `send` and `recv` (and `send_recv`) of rank `rank` of `world`. With a
/// transport, `rank` and `world` may be left out and must match it where given.
#[allow(clippy::too_many_arguments)]
pub(crate) fn link(
    py: Python<'_>,
    what: &str,
    rank: Option<usize>,
    world: Option<usize>,
    send: Option<Py<PyAny>>,
    recv: Option<Py<PyAny>>,
    send_recv: Option<Py<PyAny>>,
    transport: Option<&Bound<'_, PyTcp>>,
) -> PyResult<Net> {
    if let Some(t) = transport {
        if send.is_some() || recv.is_some() || send_recv.is_some() {
            return Err(PyTypeError::new_err(format!(
                "{what}: give either transport= or the callables send and recv, not both"
            )));
        }
        let t = t.get().inner.clone();
        for (name, given, has) in [("rank", rank, t.rank()), ("world", world, t.size())] {
            if given.is_some_and(|g| g != has) {
                return Err(PyValueError::new_err(format!(
                    "{what}: {name} {} but the transport's is {has}",
                    given.unwrap_or_default()
                )));
            }
        }
        return Ok(t);
    }
    match (rank, world, send, recv) {
        (Some(rank), Some(world), Some(send), Some(recv)) => {
            Ok(net(py_transport(py, rank, world, send, recv, send_recv)?))
        }
        _ => Err(PyTypeError::new_err(format!(
            "{what} needs rank, world and the callables send and recv, or transport= \
             (a gradpack.Tcp)"
        ))),
    }
}

/// The address to listen on: `interface` (a name or an address), else the variable
/// `GRADPACK_SOCKET_IFNAME`, else `fallback()`.
fn listen_ip(
    interface: Option<&str>,
    fallback: impl FnOnce() -> PyResult<IpAddr>,
) -> PyResult<IpAddr> {
    match named_interface(interface).map_err(err)? {
        Some(ip) => Ok(ip),
        None => fallback(),
    }
}

/// The address of this host that its packets to `host` leave from (no packet is sent:
/// a UDP socket's connect only picks the route).
fn address_toward(host: &str) -> PyResult<IpAddr> {
    let to: SocketAddr = (host, 9)
        .to_socket_addrs()
        .map_err(|e| PyValueError::new_err(format!("cannot resolve {host:?}: {e}")))?
        .next()
        .ok_or_else(|| PyValueError::new_err(format!("{host:?} has no address")))?;
    let any: SocketAddr = match to {
        SocketAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, 0).into(),
        SocketAddr::V6(_) => (std::net::Ipv6Addr::UNSPECIFIED, 0).into(),
    };
    let s = UdpSocket::bind(any)
        .and_then(|s| s.connect(to).map(|()| s))
        .and_then(|s| s.local_addr())
        .map_err(|e| PyValueError::new_err(format!("no route to {host:?}: {e}")))?;
    Ok(s.ip())
}

/// This host's address by its name (as gloo finds it when no interface is named).
fn address_of_hostname(py: Python<'_>) -> PyResult<IpAddr> {
    let name: String = py
        .import("socket")?
        .call_method0("gethostname")?
        .extract()?;
    (name.as_str(), 0)
        .to_socket_addrs()
        .map_err(|e| {
            PyValueError::new_err(format!(
                "this host's name {name:?} does not resolve ({e}): name the interface to \
                 listen on (interface= or GRADPACK_SOCKET_IFNAME)"
            ))
        })?
        .map(|a| a.ip())
        .min_by_key(IpAddr::is_ipv6)
        .ok_or_else(|| PyValueError::new_err(format!("{name:?} has no address")))
}

fn options(timeout: f64, interface: Option<IpAddr>) -> PyResult<TcpOptions> {
    if !(timeout.is_finite() && timeout > 0.0) {
        return Err(PyValueError::new_err(format!(
            "timeout must be a positive number of seconds, not {timeout}"
        )));
    }
    Ok(TcpOptions {
        timeout: Duration::from_secs_f64(timeout),
        interface,
    })
}

/// One rank's entry in an address exchange: its token (rank 0's is the job's) and its
/// listening address.
fn entry(token: u64, addr: SocketAddr) -> String {
    format!("{token:016x}@{addr}")
}

fn parse_entry(r: usize, e: &str) -> PyResult<(u64, SocketAddr)> {
    let bad = || PyValueError::new_err(format!("rank {r}'s address entry {e:?} is not gradpack's"));
    let (t, a) = e.split_once('@').ok_or_else(bad)?;
    Ok((
        u64::from_str_radix(t, 16).map_err(|_| bad())?,
        a.parse().map_err(|_| bad())?,
    ))
}

/// Listen on `ip`, hand this rank's entry to `exchange` (which returns every rank's, in
/// rank order), then connect to the others without the GIL.
fn exchanged(
    py: Python<'_>,
    rank: usize,
    world: usize,
    opts: TcpOptions,
    exchange: impl FnOnce(String) -> PyResult<Vec<String>>,
) -> PyResult<PyTcp> {
    let ip = opts.interface.unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST));
    let listener = TcpListener::bind((ip, 0))
        .map_err(|e| PyValueError::new_err(format!("cannot listen on {ip}: {e}")))?;
    let me = listener
        .local_addr()
        .map_err(|e| PyValueError::new_err(format!("the listening address: {e}")))?;
    let all = exchange(entry(draw_token(), me))?;
    if all.len() != world {
        return Err(PyValueError::new_err(format!(
            "the exchange returned {} addresses for a world of {world}",
            all.len()
        )));
    }
    let parsed = all
        .iter()
        .enumerate()
        .map(|(r, e)| parse_entry(r, e))
        .collect::<PyResult<Vec<_>>>()?;
    let token = parsed[0].0;
    let addrs: Vec<SocketAddr> = parsed.iter().map(|p| p.1).collect();
    let tcp = py
        .detach(|| Tcp::connect(rank, world, listener, &addrs, token, opts))
        .map_err(err)?;
    Ok(PyTcp::new(tcp))
}

/// The rank of a store's host to route toward: the store's own `host` (a `TCPStore`,
/// perhaps under `PrefixStore`s), else `MASTER_ADDR`.
fn store_host(store: &Bound<'_, PyAny>) -> Option<String> {
    let mut s = store.clone();
    for _ in 0..8 {
        if let Ok(h) = s.getattr("host").and_then(|h| h.extract::<String>()) {
            return Some(h);
        }
        match s.getattr("underlying_store") {
            Ok(u) => s = u,
            Err(_) => break,
        }
    }
    std::env::var("MASTER_ADDR").ok()
}

/// gradpack's native transport between ranks on any hosts: one TCP connection per pair
/// of ranks, made once, that every collective of this rank made with it (`transport=`)
/// shares. No message of a collective passes through Python: the collectives send and
/// receive from Rust with the GIL released.
///
/// Made by one of its constructors, which exchange the ranks' listening addresses and a
/// job token (drawn at random by rank 0) and then connect every pair: `from_store`
/// (through a `torch.distributed` store), `from_mpi` (one `allgather` on an mpi4py
/// communicator) or `from_env` (torchrun's `MASTER_ADDR`, `MASTER_PORT`, `RANK` and
/// `WORLD_SIZE`, with rank 0 listening on `MASTER_PORT` to hand the addresses out). A
/// connection whose handshake carries another token, world or rank is refused and
/// reported on standard error, and set-up goes on.
///
/// `interface` names the interface to listen on (a name such as `"eth0"`, or an
/// address); without it, `GRADPACK_SOCKET_IFNAME` does if set, else the constructor's
/// default (its docs say which). `timeout` (seconds) bounds set-up, each receive and
/// each queued send: a peer that sends nothing for that long, or whose connection
/// closes, is an error on this rank, never a hang. Collectives sharing one `Tcp` must
/// run one at a time, in the same order on every rank (give each its own `tag`).
#[pyclass(module = "gradpack", name = "Tcp", frozen)]
pub(crate) struct PyTcp {
    inner: Net,
    address: SocketAddr,
}

impl PyTcp {
    fn new(tcp: Tcp) -> PyTcp {
        PyTcp {
            address: tcp.address(),
            inner: net(tcp),
        }
    }
}

#[pymethods]
impl PyTcp {
    /// Rank `rank` of `world` through a `torch.distributed` store (the one
    /// `init_process_group` made: `torch.distributed.distributed_c10d._get_default_store()`,
    /// or any `TCPStore`): each rank sets `key/<rank>` to its address and reads the
    /// others'. `key` must be new for each set of connections (a job's random token, say).
    /// Default interface: the one this host reaches the store's host from.
    #[staticmethod]
    #[pyo3(signature = (store, rank, world, *, key="gradpack/tcp", interface=None, timeout=300.0))]
    fn from_store(
        py: Python<'_>,
        store: &Bound<'_, PyAny>,
        rank: usize,
        world: usize,
        key: &str,
        interface: Option<&str>,
        timeout: f64,
    ) -> PyResult<PyTcp> {
        check_world(rank, world)?;
        let ip = listen_ip(interface, || match store_host(store) {
            Some(h) => address_toward(&h),
            None => address_of_hostname(py),
        })?;
        exchanged(py, rank, world, options(timeout, Some(ip))?, |mine| {
            store.call_method1("set", (format!("{key}/{rank}"), mine))?;
            (0..world)
                .map(|r| {
                    let v = store.call_method1("get", (format!("{key}/{r}"),))?;
                    let b = v.cast::<PyBytes>().map_err(|_| {
                        PyTypeError::new_err("the store's get returned something other than bytes")
                    })?;
                    String::from_utf8(b.as_bytes().to_vec())
                        .map_err(|_| PyValueError::new_err(format!("rank {r}'s entry is not text")))
                })
                .collect()
        })
    }

    /// Every rank of the mpi4py communicator `comm` (its `Get_rank()` and `Get_size()`),
    /// the addresses exchanged by one `comm.allgather`. Default interface: the address
    /// this host's name resolves to.
    #[staticmethod]
    #[pyo3(signature = (comm, *, interface=None, timeout=300.0))]
    fn from_mpi(
        py: Python<'_>,
        comm: &Bound<'_, PyAny>,
        interface: Option<&str>,
        timeout: f64,
    ) -> PyResult<PyTcp> {
        let rank: usize = comm.call_method0("Get_rank")?.extract()?;
        let world: usize = comm.call_method0("Get_size")?.extract()?;
        check_world(rank, world)?;
        let ip = listen_ip(interface, || address_of_hostname(py))?;
        exchanged(py, rank, world, options(timeout, Some(ip))?, |mine| {
            comm.call_method1("allgather", (mine,))?.extract()
        })
    }

    /// The ranks of a job started by torchrun (or anything that sets `MASTER_ADDR`,
    /// `MASTER_PORT`, `RANK` and `WORLD_SIZE`): rank 0 listens on `MASTER_PORT`, which must
    /// be free (not the port of torch's own store: give this job another), collects the
    /// addresses and hands them out. Default interface: the one this host reaches
    /// `MASTER_ADDR` from.
    #[staticmethod]
    #[pyo3(signature = (*, interface=None, timeout=300.0))]
    fn from_env(py: Python<'_>, interface: Option<&str>, timeout: f64) -> PyResult<PyTcp> {
        let opts = options(timeout, named_interface(interface).map_err(err)?)?;
        let tcp = py.detach(|| Tcp::from_env(opts)).map_err(err)?;
        Ok(PyTcp::new(tcp))
    }

    /// This rank.
    #[getter]
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    /// The number of ranks.
    #[getter]
    fn world(&self) -> usize {
        self.inner.size()
    }

    /// The address this rank listened on for its peers (`"ip:port"`).
    #[getter]
    fn address(&self) -> String {
        self.address.to_string()
    }

    fn __repr__(&self) -> String {
        format!(
            "Tcp(rank={} of {}, address='{}')",
            self.inner.rank(),
            self.inner.size(),
            self.address
        )
    }
}

fn check_world(rank: usize, world: usize) -> PyResult<()> {
    if world == 0 || rank >= world {
        return Err(PyValueError::new_err(format!(
            "rank {rank} of a world of {world}"
        )));
    }
    Ok(())
}

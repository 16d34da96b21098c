//! A [`Transport`] over TCP between ranks on any hosts ([`Tcp`]), with no interpreter
//! and no other library in the path of a message.
//!
//! ## Set-up
//! Every pair of ranks shares one TCP connection, made once: rank `i` connects to every
//! rank `j < i` and accepts a connection from every rank `j > i`. Each side of a new
//! connection first sends a 20-byte handshake (`"GPTC"`, the version, the job's token,
//! its rank and the world size) and checks the other's; a connection whose handshake is
//! wrong (another job's token, another world, a rank that is not expected, or anything
//! that is not gradpack) is closed and reported on standard error, never read into a
//! collective, and set-up goes on waiting for the right peer.
//!
//! Where the listening addresses and the token come from is the rendezvous:
//! - [`Tcp::rendezvous`]: rank 0 listens at an agreed address, collects every rank's
//!   listening address, draws the token and hands both out (what [`Tcp::from_env`] does
//!   with torchrun's variables `MASTER_ADDR`, `MASTER_PORT`, `RANK` and `WORLD_SIZE`);
//! - [`Tcp::connect`]: the caller exchanged them itself (through a key-value store, or an
//!   all-gather of another framework) and passes this rank's bound listener.
//!
//! ## Messages
//! A message is its length (u64, little-endian) and its bytes. Sends never wait for the
//! receiver ([`Transport::send`]'s rule): each connection has a thread that writes the
//! messages queued for it, so a step's send and receive move at once (full duplex) and
//! the receive runs on the caller's thread. A receive refuses a length above what the
//! collective expects before it allocates anything (and passes over those bytes before
//! the next message from that peer).
//!
//! ## Faults
//! A peer whose connection closes (its process ended or dropped its transport) fails a
//! receive from it at once, and a send to it soon after; a peer that sends nothing, or
//! leaves a queued message unread, for the timeout ([`TcpOptions::timeout`]) is an error
//! naming it. Dropping a `Tcp` delivers what it queued first (or gives up on a reader
//! that stalls past the timeout).

use std::collections::VecDeque;
use std::hash::{BuildHasher, Hasher};
use std::io::{ErrorKind, Read, Write};
use std::net::{
    IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs,
};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::{Transport, check_rank};
use crate::error::{Error, Result};

/// The handshake's magic and the protocol's version.
const MAGIC: &[u8; 4] = b"GPTC";
const VERSION: u8 = 1;
const HANDSHAKE: usize = 20;
/// The rendezvous' magic.
const RV_MAGIC: &[u8; 4] = b"GPTR";
/// Bytes of an address in the rendezvous: family (4 or 6), 16 address bytes, port.
const ADDR_BYTES: usize = 19;
/// How long a blocking read waits before it looks at the clock again.
const SLICE: Duration = Duration::from_millis(50);

/// Options of a [`Tcp`] transport.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TcpOptions {
    /// How long set-up waits for a peer, a receive for a message, and a queued send for
    /// its reader (default 300 s).
    pub timeout: Duration,
    /// The address of the interface to listen on (default: for [`Tcp::rendezvous`], the
    /// address this host reaches rank 0 from; rank 0 listens on the rendezvous address's).
    /// [`interface_address`] finds it from an interface's name.
    pub interface: Option<IpAddr>,
}

impl Default for TcpOptions {
    fn default() -> Self {
        TcpOptions {
            timeout: Duration::from_secs(300),
            interface: None,
        }
    }
}

/// Messages queued for one peer, and its writing thread's state.
#[derive(Debug, Default)]
struct Queue {
    messages: VecDeque<Vec<u8>>,
    /// Whether the writer is writing a message it took from `messages`.
    writing: bool,
    closing: bool,
    /// Why writing to the peer failed, once it has.
    failed: Option<String>,
}

#[derive(Debug, Default)]
struct Outbox {
    queue: Mutex<Queue>,
    wake: Condvar,
    /// Signalled when the writer has written all it had, or failed.
    drained: Condvar,
}

fn lock(m: &Mutex<Queue>) -> MutexGuard<'_, Queue> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// One peer: the connection (read on the caller's thread) and its writer.
#[derive(Debug)]
struct Peer {
    stream: TcpStream,
    outbox: Arc<Outbox>,
    writer: Option<JoinHandle<()>>,
    /// Bytes of a refused message still to pass over.
    skip: u64,
}

/// A [`Transport`] between ranks over TCP (see the module docs).
#[derive(Debug)]
pub struct Tcp {
    rank: usize,
    size: usize,
    /// Where this rank listened for its peers.
    address: SocketAddr,
    timeout: Duration,
    /// Per rank; `None` for this one.
    peers: Vec<Option<Peer>>,
}

fn io_err(peer: usize, what: &str, e: std::io::Error) -> Error {
    Error::Transport {
        peer,
        reason: format!("{what}: {e}"),
    }
}

fn setup(why: String) -> Error {
    Error::Collective(format!("tcp: {why}"))
}

/// A job token for [`Tcp::connect`] that no other job is likely to draw (never 0): the
/// standard library's per-process random hash keys over the time and the process id.
/// One rank draws it and hands it to the others through the rendezvous.
pub fn draw_token() -> u64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.write_u32(std::process::id());
    h.finish() | 1
}

fn handshake(token: u64, rank: usize, size: usize) -> [u8; HANDSHAKE] {
    let mut h = [0u8; HANDSHAKE];
    h[0..4].copy_from_slice(MAGIC);
    h[4] = VERSION;
    h[8..16].copy_from_slice(&token.to_le_bytes());
    h[16..18].copy_from_slice(&(rank as u16).to_le_bytes());
    h[18..20].copy_from_slice(&(size as u16).to_le_bytes());
    h
}

/// The rank a handshake names, if it is this job's and this world's.
fn check_handshake(
    h: &[u8; HANDSHAKE],
    token: u64,
    size: usize,
) -> core::result::Result<usize, String> {
    if &h[0..4] != MAGIC {
        return Err("not a gradpack connection".into());
    }
    if h[4] != VERSION || h[5..8] != [0; 3] {
        return Err(format!("protocol version {} (this is {VERSION})", h[4]));
    }
    let t = u64::from_le_bytes(h[8..16].try_into().expect("8 bytes"));
    if t != token {
        return Err("another job's token".into());
    }
    let s = u16::from_le_bytes([h[18], h[19]]) as usize;
    if s != size {
        return Err(format!("a world of {s} ranks, not {size}"));
    }
    Ok(u16::from_le_bytes([h[16], h[17]]) as usize)
}

/// Read exactly `out.len()` bytes from `s`, waiting while bytes keep coming and for at
/// most `timeout` without any; `peer` and `what` name a failure.
fn read_full(
    s: &mut TcpStream,
    out: &mut [u8],
    timeout: Duration,
    peer: usize,
    what: &str,
) -> Result<()> {
    let mut got = 0;
    let mut since = Instant::now();
    while got < out.len() {
        match s.read(&mut out[got..]) {
            Ok(0) => {
                return Err(Error::Transport {
                    peer,
                    reason: format!("closed the connection ({what})"),
                });
            }
            Ok(n) => {
                got += n;
                since = Instant::now();
            }
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                if since.elapsed() > timeout {
                    return Err(Error::Transport {
                        peer,
                        reason: format!("{what} within {timeout:?}"),
                    });
                }
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(io_err(peer, what, e)),
        }
    }
    Ok(())
}

impl Tcp {
    /// Rank `rank` of a world of `size` whose ranks listen at `addrs` (this rank's own
    /// on `listener`, already bound), all using the job's `token` (the same on every
    /// rank, different for every job). Waits up to the timeout for every connection.
    pub fn connect(
        rank: usize,
        size: usize,
        listener: TcpListener,
        addrs: &[SocketAddr],
        token: u64,
        options: TcpOptions,
    ) -> Result<Tcp> {
        check_rank(rank, size)?;
        if addrs.len() != size {
            return Err(setup(format!(
                "{} addresses for a world of {size}",
                addrs.len()
            )));
        }
        if size > usize::from(u16::MAX) {
            return Err(setup(format!("a world of {size} ranks (at most 65535)")));
        }
        let timeout = options.timeout;
        let start = Instant::now();
        let address = listener
            .local_addr()
            .map_err(|e| setup(format!("the listener has no address: {e}")))?;
        let mut streams: Vec<Option<TcpStream>> = (0..size).map(|_| None).collect();
        // Connect to every lower rank.
        for (j, addr) in addrs.iter().enumerate().take(rank) {
            let mut s = dial(*addr, j, (start, timeout))?;
            s.write_all(&handshake(token, rank, size))
                .map_err(|e| io_err(j, "handshake", e))?;
            let mut h = [0u8; HANDSHAKE];
            read_full(&mut s, &mut h, timeout, j, "sent no handshake")?;
            match check_handshake(&h, token, size) {
                Ok(r) if r == j => streams[j] = Some(s),
                Ok(r) => return Err(setup(format!("{addr} answered as rank {r}, not {j}"))),
                Err(why) => return Err(setup(format!("{addr} (rank {j}): {why}"))),
            }
        }
        // Accept every higher rank; refuse anything else and keep waiting.
        let accepted = accept_ranks(&listener, rank + 1..size, (start, timeout), |s, taken| {
            let mut h = [0u8; HANDSHAKE];
            read_full(s, &mut h, GREETING.min(timeout), size, "handshake")
                .map_err(|e| e.to_string())?;
            let r = check_handshake(&h, token, size)?;
            if r <= rank || r >= size || taken(r) {
                return Err(format!("rank {r} is not one this rank waits for"));
            }
            s.write_all(&handshake(token, rank, size))
                .map_err(|e| e.to_string())?;
            Ok((r, ()))
        })
        .map_err(|e| match e {
            Error::Transport { peer, .. } => Error::Transport {
                peer,
                reason: format!("did not connect within {timeout:?}"),
            },
            e => e,
        })?;
        for (r, got) in accepted.into_iter().enumerate() {
            if let Some((s, ())) = got {
                streams[r] = Some(s);
            }
        }
        let mut peers = Vec::with_capacity(size);
        for (j, s) in streams.into_iter().enumerate() {
            let Some(s) = s else {
                peers.push(None);
                continue;
            };
            let _ = s.set_nodelay(true);
            let w = s.try_clone().map_err(|e| io_err(j, "socket", e))?;
            w.set_write_timeout(Some(timeout))
                .map_err(|e| io_err(j, "socket option", e))?;
            let outbox = Arc::new(Outbox::default());
            let ob = outbox.clone();
            let writer = std::thread::Builder::new()
                .name(format!("gradpack-tcp-{rank}-{j}"))
                .spawn(move || write_loop(w, &ob))
                .map_err(|e| setup(format!("no writing thread: {e}")))?;
            peers.push(Some(Peer {
                stream: s,
                outbox,
                writer: Some(writer),
                skip: 0,
            }));
        }
        Ok(Tcp {
            rank,
            size,
            address,
            timeout,
            peers,
        })
    }

    /// Rank `rank` of a world of `size`, meeting at `master` (an address of rank 0's
    /// host and a free port, the same on every rank): rank 0 listens there, every other
    /// rank connects, rank 0 hands out every rank's listening address and a token it
    /// draws, then the ranks connect to one another ([`Tcp::connect`]).
    pub fn rendezvous(
        master: SocketAddr,
        rank: usize,
        size: usize,
        options: TcpOptions,
    ) -> Result<Tcp> {
        check_rank(rank, size)?;
        let timeout = options.timeout;
        let start = Instant::now();
        let bind = |ip: IpAddr| {
            TcpListener::bind((ip, 0)).map_err(|e| setup(format!("cannot listen on {ip}: {e}")))
        };
        if rank == 0 {
            let rv = TcpListener::bind(master)
                .map_err(|e| setup(format!("cannot listen for the rendezvous on {master}: {e}")))?;
            let listener = bind(options.interface.unwrap_or(master.ip()))?;
            let mut addrs = vec![listener.local_addr().map_err(|e| setup(e.to_string()))?; size];
            let token = draw_token();
            let joined = accept_ranks(&rv, 1..size, (start, timeout), |s, taken| {
                let mut m = [0u8; 12 + ADDR_BYTES];
                read_full(s, &mut m, GREETING.min(timeout), size, "hello")
                    .map_err(|e| e.to_string())?;
                if &m[0..4] != RV_MAGIC {
                    return Err("not a gradpack rendezvous".into());
                }
                let r = u32::from_le_bytes(m[4..8].try_into().expect("4 bytes")) as usize;
                let n = u32::from_le_bytes(m[8..12].try_into().expect("4 bytes")) as usize;
                if n != size || r == 0 || r >= size || taken(r) {
                    return Err(format!("rank {r} of {n}: not expected"));
                }
                Ok((r, read_addr(&m[12..])?))
            })?;
            let mut joined: Vec<Option<TcpStream>> = joined
                .into_iter()
                .enumerate()
                .map(|(r, got)| {
                    got.map(|(s, a)| {
                        addrs[r] = a;
                        s
                    })
                })
                .collect();
            let mut table = Vec::with_capacity(12 + size * ADDR_BYTES);
            table.extend_from_slice(RV_MAGIC);
            table.extend_from_slice(&token.to_le_bytes());
            addrs.iter().for_each(|a| write_addr(&mut table, a));
            for (r, s) in joined.iter_mut().enumerate() {
                if let Some(s) = s {
                    s.write_all(&table)
                        .map_err(|e| io_err(r, "rendezvous", e))?;
                }
            }
            drop(rv);
            return Tcp::connect(0, size, listener, &addrs, token, options);
        }
        let mut s = dial(master, 0, (start, timeout))?;
        let ip = match options.interface {
            Some(ip) => ip,
            None => s.local_addr().map_err(|e| setup(e.to_string()))?.ip(),
        };
        let listener = bind(ip)?;
        let mut hello = Vec::with_capacity(12 + ADDR_BYTES);
        hello.extend_from_slice(RV_MAGIC);
        hello.extend_from_slice(&(rank as u32).to_le_bytes());
        hello.extend_from_slice(&(size as u32).to_le_bytes());
        write_addr(
            &mut hello,
            &listener.local_addr().map_err(|e| setup(e.to_string()))?,
        );
        s.write_all(&hello)
            .map_err(|e| io_err(0, "rendezvous", e))?;
        let mut table = vec![0u8; 12 + size * ADDR_BYTES];
        read_full(&mut s, &mut table, timeout, 0, "handed out no addresses")?;
        if &table[0..4] != RV_MAGIC {
            return Err(setup(
                "rank 0 answered the rendezvous with something else".into(),
            ));
        }
        let token = u64::from_le_bytes(table[4..12].try_into().expect("8 bytes"));
        let addrs = table[12..]
            .chunks_exact(ADDR_BYTES)
            .map(read_addr)
            .collect::<core::result::Result<Vec<_>, _>>()
            .map_err(setup)?;
        Tcp::connect(rank, size, listener, &addrs, token, options)
    }

    /// [`Tcp::rendezvous`] at torchrun's `MASTER_ADDR` and `MASTER_PORT`, as rank `RANK`
    /// of `WORLD_SIZE` (all four environment variables must be set; the port must be
    /// free for rank 0 to listen on, so not the one torch's own store uses). Where
    /// `options` names no interface, `GRADPACK_SOCKET_IFNAME` (an interface's name or an
    /// address, as [`interface_address`] takes) names the one to listen on, if set.
    pub fn from_env(mut options: TcpOptions) -> Result<Tcp> {
        if options.interface.is_none() {
            options.interface = named_interface(None)?;
        }
        let var = |k: &str| {
            std::env::var(k).map_err(|_| setup(format!("environment variable {k} is not set")))
        };
        let num = |k: &str| -> Result<usize> {
            var(k)?
                .trim()
                .parse()
                .map_err(|_| setup(format!("{k} is not a number")))
        };
        let (host, port) = (var("MASTER_ADDR")?, num("MASTER_PORT")?);
        let port = u16::try_from(port).map_err(|_| setup(format!("MASTER_PORT {port}")))?;
        let master = (host.as_str(), port)
            .to_socket_addrs()
            .map_err(|e| setup(format!("MASTER_ADDR {host}: {e}")))?
            .next()
            .ok_or_else(|| setup(format!("MASTER_ADDR {host} has no address")))?;
        Tcp::rendezvous(master, num("RANK")?, num("WORLD_SIZE")?, options)
    }

    /// The address this rank listened on for its peers.
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    fn peer(&mut self, r: usize) -> Result<&mut Peer> {
        check_rank(r, self.size)?;
        let me = self.rank;
        self.peers[r].as_mut().ok_or_else(|| Error::Transport {
            peer: r,
            reason: format!("is this rank ({me}): no connection to itself"),
        })
    }
}

/// The address to listen on for `name`: an IP address as written (`10.0.0.2`, `::1`), or
/// the name of one of this host's network interfaces (`eth0`: its first IPv4 address,
/// else its first IPv6 one), as gloo's `GLOO_SOCKET_IFNAME` names one.
pub fn interface_address(name: &str) -> Result<IpAddr> {
    let name = name.trim();
    if let Ok(ip) = name.parse::<IpAddr>() {
        return Ok(ip);
    }
    let all = if_addrs::get_if_addrs()
        .map_err(|e| setup(format!("cannot list the network interfaces: {e}")))?;
    let mut of: Vec<IpAddr> = all
        .iter()
        .filter(|i| i.name == name)
        .map(if_addrs::Interface::ip)
        .collect();
    of.sort_by_key(IpAddr::is_ipv6);
    of.first().copied().ok_or_else(|| {
        let mut names: Vec<&str> = all.iter().map(|i| i.name.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        setup(format!(
            "no interface {name:?} with an address (this host has: {})",
            names.join(", ")
        ))
    })
}

/// The address of the interface `name` names ([`interface_address`]), else of the one
/// the environment variable `GRADPACK_SOCKET_IFNAME` names, if set.
pub fn named_interface(name: Option<&str>) -> Result<Option<IpAddr>> {
    match name
        .map(str::to_owned)
        .or_else(|| std::env::var("GRADPACK_SOCKET_IFNAME").ok())
    {
        Some(n) => interface_address(&n).map(Some),
        None => Ok(None),
    }
}

/// How long a new connection may take to say who it is.
const GREETING: Duration = Duration::from_secs(2);

/// A connection to rank `peer` at `addr`, tried again until the deadline (`start` plus
/// `timeout`: the peer may not listen yet), its reads waking every [`SLICE`].
fn dial(addr: SocketAddr, peer: usize, (start, timeout): (Instant, Duration)) -> Result<TcpStream> {
    loop {
        match TcpStream::connect_timeout(&addr, Duration::from_millis(500)) {
            Ok(s) => {
                s.set_read_timeout(Some(SLICE))
                    .map_err(|e| io_err(peer, "socket option", e))?;
                return Ok(s);
            }
            Err(e) if start.elapsed() > timeout => {
                return Err(io_err(peer, &format!("cannot connect to {addr}"), e));
            }
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// Accepted connections on `listener`, one from each rank of `ranks`, until the deadline.
/// `greet` reads a new connection's greeting (its reads wake every [`SLICE`]) and names
/// its rank and what it brought, given whether a rank has come already; a connection it
/// refuses is closed and reported on standard error, and waiting goes on. Past the
/// deadline, an error names the first rank still missing.
#[allow(clippy::type_complexity)]
fn accept_ranks<T>(
    listener: &TcpListener,
    ranks: std::ops::Range<usize>,
    (start, timeout): (Instant, Duration),
    mut greet: impl FnMut(
        &mut TcpStream,
        &dyn Fn(usize) -> bool,
    ) -> core::result::Result<(usize, T), String>,
) -> Result<Vec<Option<(TcpStream, T)>>> {
    let mut got: Vec<Option<(TcpStream, T)>> = (0..ranks.end).map(|_| None).collect();
    listener
        .set_nonblocking(true)
        .map_err(|e| setup(format!("listener: {e}")))?;
    let mut missing = ranks.len();
    while missing > 0 {
        match listener.accept() {
            Ok((mut s, from)) => {
                let r = s
                    .set_nonblocking(false)
                    .and_then(|()| s.set_read_timeout(Some(SLICE)))
                    .map_err(|e| e.to_string())
                    .and_then(|()| greet(&mut s, &|r| got.get(r).is_some_and(Option::is_some)));
                match r {
                    Ok((r, t)) => {
                        got[r] = Some((s, t));
                        missing -= 1;
                    }
                    Err(why) => {
                        eprintln!("gradpack: tcp: refused a connection from {from}: {why}");
                        let _ = s.shutdown(Shutdown::Both);
                    }
                }
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                if start.elapsed() > timeout {
                    let who = ranks.clone().find(|&r| got[r].is_none()).unwrap_or(0);
                    return Err(Error::Transport {
                        peer: who,
                        reason: format!("did not come within {timeout:?}"),
                    });
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(setup(format!("accept: {e}"))),
        }
    }
    Ok(got)
}

fn write_addr(out: &mut Vec<u8>, a: &SocketAddr) {
    let (family, ip) = match a.ip() {
        IpAddr::V4(v) => (4u8, v.to_ipv6_mapped().octets()),
        IpAddr::V6(v) => (6u8, v.octets()),
    };
    out.push(family);
    out.extend_from_slice(&ip);
    out.extend_from_slice(&a.port().to_le_bytes());
}

fn read_addr(b: &[u8]) -> core::result::Result<SocketAddr, String> {
    let ip: [u8; 16] = b[1..17].try_into().expect("16 bytes");
    let port = u16::from_le_bytes([b[17], b[18]]);
    let ip = match b[0] {
        4 => IpAddr::V4(
            Ipv6Addr::from(ip)
                .to_ipv4_mapped()
                .unwrap_or(Ipv4Addr::UNSPECIFIED),
        ),
        6 => IpAddr::V6(Ipv6Addr::from(ip)),
        f => return Err(format!("address family {f}")),
    };
    Ok(SocketAddr::new(ip, port))
}

/// A peer's writing thread: its queued messages, in order, until the transport closes.
fn write_loop(mut s: TcpStream, ob: &Outbox) {
    loop {
        let msg = {
            let mut q = lock(&ob.queue);
            q.writing = false;
            loop {
                if let Some(m) = q.messages.pop_front() {
                    q.writing = true;
                    break m;
                }
                ob.drained.notify_all();
                if q.closing || q.failed.is_some() {
                    let _ = s.shutdown(Shutdown::Write);
                    return;
                }
                q = ob.wake.wait(q).unwrap_or_else(|e| e.into_inner());
            }
        };
        if let Err(e) = s.write_all(&msg) {
            let mut q = lock(&ob.queue);
            q.failed = Some(match e.kind() {
                ErrorKind::WouldBlock | ErrorKind::TimedOut => {
                    "did not read a message within the timeout".to_string()
                }
                _ => format!("the connection failed: {e}"),
            });
            q.messages.clear();
            q.writing = false;
            ob.drained.notify_all();
            return;
        }
    }
}

impl Transport for Tcp {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn send(&mut self, msg: &[u8], to: usize) -> Result<()> {
        let p = self.peer(to)?;
        let mut framed = Vec::new();
        framed
            .try_reserve_exact(msg.len().saturating_add(8))
            .map_err(|_| Error::OutOfMemory {
                bytes: msg.len() as u64 + 8,
                what: "a message queued for TCP",
            })?;
        framed.extend_from_slice(&(msg.len() as u64).to_le_bytes());
        framed.extend_from_slice(msg);
        let mut q = lock(&p.outbox.queue);
        if let Some(why) = &q.failed {
            return Err(Error::Transport {
                peer: to,
                reason: why.clone(),
            });
        }
        q.messages.push_back(framed);
        drop(q);
        p.outbox.wake.notify_one();
        Ok(())
    }

    fn recv(&mut self, buf: &mut Vec<u8>, from: usize, max: usize) -> Result<()> {
        let timeout = self.timeout;
        let p = self.peer(from)?;
        // What is left of a refused message first.
        let mut scratch = [0u8; 4096];
        while p.skip > 0 {
            let n = p.skip.min(scratch.len() as u64) as usize;
            read_full(
                &mut p.stream,
                &mut scratch[..n],
                timeout,
                from,
                "sent nothing",
            )?;
            p.skip -= n as u64;
        }
        let mut head = [0u8; 8];
        read_full(&mut p.stream, &mut head, timeout, from, "sent nothing")?;
        let claim = u64::from_le_bytes(head);
        if claim > max as u64 {
            p.skip = claim;
            return Err(super::too_long(from, claim, max));
        }
        let len = claim as usize;
        if buf.len() < len {
            crate::alloc::lengthen(buf, len, "a message received over TCP")?;
        } else {
            buf.truncate(len);
        }
        read_full(&mut p.stream, buf, timeout, from, "sent nothing")
    }

    fn flush(&mut self) -> Result<()> {
        // Each writer already waits at most the timeout for its socket, so this waits at
        // most that long per peer with a message in flight (a little more for the wake).
        let limit = self.timeout + SLICE;
        for (r, p) in self.peers.iter().enumerate() {
            let Some(p) = p else { continue };
            let start = Instant::now();
            let mut q = lock(&p.outbox.queue);
            while (q.writing || !q.messages.is_empty()) && q.failed.is_none() {
                let left = limit.saturating_sub(start.elapsed());
                if left.is_zero() {
                    return Err(Error::Transport {
                        peer: r,
                        reason: format!("did not read its messages within {:?}", self.timeout),
                    });
                }
                q = p
                    .outbox
                    .drained
                    .wait_timeout(q, left)
                    .map(|(q, _)| q)
                    .unwrap_or_else(|e| e.into_inner().0);
            }
            if let Some(why) = &q.failed {
                return Err(Error::Transport {
                    peer: r,
                    reason: why.clone(),
                });
            }
        }
        Ok(())
    }
}

impl Drop for Tcp {
    fn drop(&mut self) {
        // Deliver what is queued first (a send has completed for its caller).
        for p in self.peers.iter_mut().flatten() {
            lock(&p.outbox.queue).closing = true;
            p.outbox.wake.notify_one();
        }
        for p in self.peers.iter_mut().flatten() {
            if let Some(h) = p.writer.take() {
                let _ = h.join();
            }
        }
    }
}

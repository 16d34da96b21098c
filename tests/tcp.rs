//! The TCP transport on the loopback: set-up by rendezvous, the collectives' bits equal to
//! the in-process transport's, a rank that leaves, a connection of another job refused
//! while set-up goes on, and a peer's claim of a huge message refused without an
//! allocation. Ranks are threads here, each with its own sockets, as processes would be.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gradpack::collective::{
    AllReduce, AllReduceOptions, Comm, Feedback, Hierarchical, Nodes, Shared, Strategy,
    StrategyChoice, Tcp, TcpOptions, Transport, local,
};
use gradpack::{CodecSpec, Error};

fn opts(timeout_s: u64) -> TcpOptions {
    TcpOptions {
        timeout: Duration::from_secs(timeout_s),
        interface: None,
    }
}

/// A port on the loopback that nothing listens on now.
fn free_addr() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

fn input(rank: usize, n: usize, step: u64) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 31 + rank * 17 + step as usize * 7) % 97) as f32 / 48.0 - 1.0)
        .collect()
}

/// Every rank's outputs of three steps of a ring with error feedback at both sites, an
/// all-gather and a two-level all-reduce (two nodes of two), on `comm`.
fn steps<T: Transport>(comm: &mut Comm<T>) -> gradpack::Result<Vec<Vec<u32>>> {
    let (n, rank) = (1001, comm.rank());
    let codec: CodecSpec = "int8".parse().unwrap();
    let o = |s, feedback| AllReduceOptions {
        strategy: StrategyChoice::Forced(s),
        feedback,
        pieces: 2,
        ..Default::default()
    };
    let mut ring = AllReduce::new(
        codec,
        n,
        &*comm,
        o(Strategy::CompressedRing, Feedback::WorkerAndOwner),
    )?;
    let mut gather = AllReduce::new(
        codec,
        n,
        &*comm,
        o(Strategy::CompressedAllGather, Feedback::Worker),
    )?;
    let nodes = Nodes::uniform(comm.size(), 2)?;
    let idn: CodecSpec = "identity".parse().unwrap();
    let mut two = Hierarchical::new(
        codec,
        idn,
        n,
        &*comm,
        nodes,
        o(Strategy::CompressedRing, Feedback::None),
    )?;
    let mut out = Vec::new();
    for step in 0..3 {
        let x = input(rank, n, step);
        let mut y = vec![0.0; n];
        ring.run(comm, &x, &mut y, step)?;
        out.push(y.iter().map(|v| v.to_bits()).collect());
        gather.run(comm, &x, &mut y, step)?;
        out.push(y.iter().map(|v| v.to_bits()).collect());
        two.run(comm, &x, &mut y, step)?;
        out.push(y.iter().map(|v| v.to_bits()).collect());
    }
    Ok(out)
}

/// Per rank, the bits of every step's outputs.
type Bits = Vec<Vec<Vec<u32>>>;

/// [`steps`] on `p` ranks over TCP (behind a type-erased [`Shared`], what the Python
/// package's collectives hold a clone each of, with `shared`) and in-process: both runs'
/// bits.
fn over_tcp_and_in_process(p: usize, shared: bool) -> (Bits, Bits) {
    let want: Vec<_> = local::run(p, None, |mut c| steps(&mut c))
        .into_iter()
        .map(Result::unwrap)
        .collect();
    let master = free_addr();
    let got: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..p)
            .map(|r| {
                s.spawn(move || {
                    let t = Tcp::rendezvous(master, r, p, opts(30))?;
                    if !shared {
                        return steps(&mut Comm::new(t));
                    }
                    let t: Arc<Mutex<dyn Transport + Send>> = Arc::new(Mutex::new(t));
                    let mut c = Comm::new(Shared::from(t).clone());
                    assert_eq!((c.rank(), c.size()), (r, p));
                    steps(&mut c)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap().unwrap()).collect()
    });
    (got, want)
}

#[test]
fn collectives_over_tcp_give_the_in_process_bits() {
    let (got, want) = over_tcp_and_in_process(4, false);
    assert_eq!(got, want);
}

#[test]
fn a_shared_transport_carries_the_collectives_of_one_rank() {
    // The ring, the all-gather and the two-level all-reduce through a shared handle.
    let (got, want) = over_tcp_and_in_process(3, true);
    assert_eq!(got, want);
}

#[test]
fn a_rank_that_leaves_is_an_error_at_once_not_after_the_timeout() {
    let master = free_addr();
    let start = Instant::now();
    let got: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..3)
            .map(|r| {
                s.spawn(move || {
                    let mut t = Tcp::rendezvous(master, r, 3, opts(60))?;
                    if r == 2 {
                        return Ok(());
                    }
                    t.recv(&mut Vec::new(), 2, 100)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(got[2].is_ok());
    for e in &got[..2] {
        assert!(
            matches!(e, Err(Error::Transport { peer: 2, reason }) if reason.contains("closed")),
            "{e:?}"
        );
    }
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "{:?}",
        start.elapsed()
    );
}

/// A handshake as the wire format gives it.
fn handshake(token: u64, rank: u16, size: u16) -> Vec<u8> {
    let mut h = b"GPTC\x01\0\0\0".to_vec();
    h.extend(token.to_le_bytes());
    h.extend(rank.to_le_bytes());
    h.extend(size.to_le_bytes());
    h
}

#[test]
fn a_connection_of_another_job_is_refused_and_set_up_goes_on() {
    let (l0, l1) = (
        TcpListener::bind("127.0.0.1:0").unwrap(),
        TcpListener::bind("127.0.0.1:0").unwrap(),
    );
    let addrs = [l0.local_addr().unwrap(), l1.local_addr().unwrap()];
    let got: Vec<Result<Vec<u8>, Error>> = std::thread::scope(|s| {
        let a = s.spawn(move || {
            let mut t = Tcp::connect(0, 2, l0, &addrs, 42, opts(20))?;
            let mut buf = Vec::new();
            t.recv(&mut buf, 1, 100)?;
            Ok(buf)
        });
        // Before rank 1: another job's rank 1, then something that is not gradpack.
        let mut rogue = TcpStream::connect(addrs[0]).unwrap();
        rogue.write_all(&handshake(7, 1, 2)).unwrap();
        let mut junk = TcpStream::connect(addrs[0]).unwrap();
        junk.write_all(b"GET / HTTP/1.0\r\n\r\n\0\0").unwrap();
        let b = s.spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            let mut t = Tcp::connect(1, 2, l1, &addrs, 42, opts(20))?;
            t.send(b"hello", 0)?;
            Ok(Vec::new())
        });
        // The refused connections are closed without an answer.
        let mut answer = Vec::new();
        rogue
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        assert!(rogue.read_to_end(&mut answer).is_ok_and(|n| n == 0) || answer.is_empty());
        vec![a.join().unwrap(), b.join().unwrap()]
    });
    assert_eq!(got[0].as_ref().unwrap(), b"hello");
    assert!(got[1].is_ok());
}

#[test]
fn a_peer_claiming_a_huge_message_is_refused_without_an_allocation() {
    let l0 = TcpListener::bind("127.0.0.1:0").unwrap();
    let addrs = [l0.local_addr().unwrap(), free_addr()];
    std::thread::scope(|s| {
        let a = s.spawn(move || {
            let mut t = Tcp::connect(0, 2, l0, &addrs, 9, opts(20)).unwrap();
            let mut buf = Vec::new();
            let e = t.recv(&mut buf, 1, 1000).unwrap_err();
            assert_eq!(buf.capacity(), 0, "nothing allocated for the claim");
            e
        });
        // Rank 1 by hand: a right handshake, then a length of 1 TiB and no bytes.
        let mut raw = TcpStream::connect(addrs[0]).unwrap();
        raw.write_all(&handshake(9, 1, 2)).unwrap();
        let mut h = [0u8; 20];
        raw.read_exact(&mut h).unwrap();
        assert_eq!(&h[0..4], b"GPTC");
        raw.write_all(&(1u64 << 40).to_le_bytes()).unwrap();
        let e = a.join().unwrap();
        assert!(
            matches!(e, Error::MessageTooLong { peer: 1, len, max: 1000 } if len == 1 << 40),
            "{e}"
        );
    });
}

#[test]
fn bad_arguments_are_errors() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let a = l.local_addr().unwrap();
    assert!(Tcp::connect(2, 2, l, &[a, a], 1, opts(1)).is_err());
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    assert!(Tcp::connect(0, 2, l, &[a], 1, opts(1)).is_err());
    // A world of one needs no connection.
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let a = l.local_addr().unwrap();
    let mut t = Tcp::connect(0, 1, l, &[a], 1, opts(1)).unwrap();
    assert!(t.send(b"x", 0).is_err());
    assert!(t.recv(&mut Vec::new(), 0, 10).is_err());
}

#[test]
fn interfaces_are_named_by_address_or_by_name() {
    use gradpack::collective::interface_address;
    use std::net::{IpAddr, Ipv4Addr};
    assert_eq!(
        interface_address("10.1.2.3").unwrap(),
        IpAddr::V4(Ipv4Addr::new(10, 1, 2, 3))
    );
    assert_eq!(
        interface_address(" ::1 ").unwrap(),
        "::1".parse::<IpAddr>().unwrap()
    );
    // The loopback interface of Linux, by name: its IPv4 address first.
    if cfg!(target_os = "linux") {
        assert_eq!(
            interface_address("lo").unwrap(),
            IpAddr::V4(Ipv4Addr::LOCALHOST)
        );
    }
    let e = interface_address("no-such-if0").unwrap_err().to_string();
    assert!(
        e.contains("no-such-if0") && e.contains("this host has"),
        "{e}"
    );
    // Tokens differ from call to call and are never 0.
    let (a, b) = (
        gradpack::collective::draw_token(),
        gradpack::collective::draw_token(),
    );
    assert!(a != b && a != 0 && b != 0);
}

#[test]
fn flush_waits_until_sent_messages_have_left_and_fails_on_a_peer_that_never_reads() {
    // 64 MiB is more than the sockets' buffers hold: the writer is still writing when
    // the send returns. Rank 1 reads it after 300 ms (flush then returns Ok, having
    // waited for that); rank 2 never reads (flush fails after the 1 s timeout).
    let master = free_addr();
    let big = vec![7u8; 64 << 20];
    let got: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..3)
            .map(|r| {
                let big = &big;
                s.spawn(move || -> gradpack::Result<Duration> {
                    let mut t = Tcp::rendezvous(master, r, 3, opts(1))?;
                    match r {
                        0 => {
                            t.send(big, 1)?;
                            let start = Instant::now();
                            t.flush()?;
                            let waited = start.elapsed();
                            t.send(big, 2)?;
                            let e = t.flush().unwrap_err();
                            assert!(matches!(e, Error::Transport { peer: 2, .. }), "{e}");
                            Ok(waited)
                        }
                        1 => {
                            std::thread::sleep(Duration::from_millis(300));
                            let mut buf = Vec::new();
                            t.recv(&mut buf, 0, 64 << 20)?;
                            assert!(buf.len() == 64 << 20 && buf.iter().all(|&b| b == 7));
                            Ok(Duration::ZERO)
                        }
                        _ => {
                            std::thread::sleep(Duration::from_secs(3));
                            Ok(Duration::ZERO)
                        }
                    }
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let waited = got[0].as_ref().unwrap();
    assert!(*waited >= Duration::from_millis(150), "{waited:?}");
    assert!(got[1].is_ok() && got[2].is_ok(), "{got:?}");
}

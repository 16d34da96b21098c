//! The shared-memory transport between ranks of one host, and `Routed`: messages of every
//! size arrive whole and in order even when every rank sends before it receives; the
//! collectives over it give the same bits as over the in-process transport; a silent
//! peer, a missing peer and a reader that never reads are errors naming the peer within
//! the timeout; the files are gone once every rank has mapped them.
//!
//! Ranks are threads here: each maps the files on its own, as processes would.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use gradpack::collective::{
    AllReduce, AllReduceOptions, Comm, Feedback, Hierarchical, Nodes, ReduceOp, Routed,
    SharedMemory, SharedMemoryOptions, Strategy, StrategyChoice, Transport, local,
};
use gradpack::{CodecSpec, Error};

/// A fresh, empty directory for one test's files, and a name no other test uses.
fn place(test: &str) -> (PathBuf, String) {
    static N: AtomicU64 = AtomicU64::new(0);
    let k = N.fetch_add(1, Ordering::Relaxed);
    let name = format!("t{}-{test}-{k}", std::process::id());
    let dir = std::env::temp_dir().join(format!("gradpack-shm-{name}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    (dir, name)
}

fn options(dir: &Path, capacity: usize, timeout_ms: u64) -> SharedMemoryOptions {
    SharedMemoryOptions {
        capacity,
        timeout: Duration::from_millis(timeout_ms),
        dir: Some(dir.to_path_buf()),
        stage: 0,
        job: 0,
    }
}

/// `f` on every rank of `host` (a world of `size`), each its own thread with its own
/// transport.
fn on_host<R: Send>(
    size: usize,
    host: &[usize],
    opts: &SharedMemoryOptions,
    name: &str,
    f: impl Fn(SharedMemory) -> gradpack::Result<R> + Sync,
) -> Vec<gradpack::Result<R>> {
    std::thread::scope(|s| {
        let hs: Vec<_> = host
            .iter()
            .map(|&r| {
                let f = &f;
                s.spawn(move || f(SharedMemory::open(name, r, size, host, opts.clone())?))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn message(from: usize, to: usize, k: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u64 * 31 + from as u64 * 7 + to as u64 * 13 + k as u64 * 101) as u8)
        .collect()
}

/// Lengths around the ring's capacity (256 here) and far past it.
const LENGTHS: [usize; 12] = [0, 1, 7, 8, 9, 247, 248, 255, 256, 257, 1000, 70_000];

#[test]
fn messages_arrive_whole_and_in_order_when_every_rank_sends_first() {
    let (dir, name) = place("order");
    let host = [0, 1, 2, 3];
    let o = options(&dir, 256, 20_000);
    let got = on_host(4, &host, &o, &name, |mut t| {
        let me = t.rank();
        // Every message to every peer first (most do not fit: they queue), then receive.
        for (k, &len) in LENGTHS.iter().enumerate() {
            for to in (0..4).filter(|&q| q != me) {
                t.send(&message(me, to, k, len), to)?;
            }
        }
        let mut buf = vec![0xAA; 3];
        for (k, &len) in LENGTHS.iter().enumerate() {
            for from in (0..4).filter(|&q| q != me) {
                t.recv(&mut buf, from, usize::MAX)?;
                assert_eq!(
                    buf,
                    message(from, me, k, len),
                    "{from} -> {me}, message {k}"
                );
            }
        }
        Ok(())
    });
    for r in got {
        r.unwrap();
    }
    // Every rank mapped every file, so every name is gone.
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn send_recv_in_a_ring_of_large_messages() {
    let (dir, name) = place("ring");
    let host = [1, 3, 4];
    let o = options(&dir, 4096, 20_000);
    let got = on_host(5, &host, &o, &name, |mut t| {
        let me = host.iter().position(|&r| r == t.rank()).unwrap();
        let (next, prev) = (host[(me + 1) % 3], host[(me + 2) % 3]);
        let mut buf = Vec::new();
        for k in 0..20 {
            let len = 1 + k * 9973;
            t.send_recv(
                &message(t.rank(), next, k, len),
                next,
                &mut buf,
                prev,
                usize::MAX,
            )?;
            assert_eq!(buf, message(prev, t.rank(), k, len));
        }
        Ok(())
    });
    for r in got {
        r.unwrap();
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

fn spec(s: &str) -> CodecSpec {
    s.parse().unwrap()
}

fn input(rank: usize, n: usize, step: u64) -> Vec<f32> {
    (0..n)
        .map(|j| ((j as f32 * 0.37 + rank as f32 * 1.7 + step as f32).sin()) * (1.0 + rank as f32))
        .collect()
}

fn ar_opts(strategy: Strategy, feedback: Feedback) -> AllReduceOptions {
    AllReduceOptions {
        op: ReduceOp::Mean,
        strategy: StrategyChoice::Forced(strategy),
        feedback,
        pieces: 2,
        ..Default::default()
    }
}

/// Three steps of `codec` by `strategy` on `comm`, flat or by `nodes`.
fn steps<T: Transport>(
    comm: &mut Comm<T>,
    codec: &str,
    strategy: Strategy,
    nodes: Option<&Nodes>,
    n: usize,
) -> gradpack::Result<Vec<Vec<f32>>> {
    let o = ar_opts(strategy, Feedback::WorkerAndOwner);
    let mut outs = Vec::new();
    match nodes {
        Some(nd) => {
            let mut h = Hierarchical::new(spec(codec), spec("identity"), n, comm, nd.clone(), o)?;
            for s in 0..3 {
                let x = input(comm.transport().rank(), n, s);
                // The second step in place (through the stages too, where they serve).
                let out = if s == 1 {
                    let mut data = x;
                    h.run_in_place(comm, &mut data, 7 + s)?;
                    data
                } else {
                    let mut out = vec![f32::NAN; n];
                    h.run(comm, &x, &mut out, 7 + s)?;
                    out
                };
                outs.push(out);
            }
        }
        None => {
            let mut ar = AllReduce::new(spec(codec), n, comm, o)?;
            for s in 0..3 {
                let mut out = vec![f32::NAN; n];
                ar.run(comm, &input(comm.transport().rank(), n, s), &mut out, 7 + s)?;
                outs.push(out);
            }
        }
    }
    Ok(outs)
}

fn bits(v: &[Vec<Vec<f32>>]) -> Vec<Vec<Vec<u32>>> {
    v.iter()
        .map(|r| {
            r.iter()
                .map(|s| s.iter().map(|x| x.to_bits()).collect())
                .collect()
        })
        .collect()
}

#[test]
fn collectives_over_shared_memory_give_the_in_process_bits() {
    let n = 10_007;
    for (codec, strategy) in [
        ("int8", Strategy::CompressedRing),
        ("topk:ratio=0.05", Strategy::CompressedAllGather),
        ("identity", Strategy::Fp32Ring),
    ] {
        let want: Vec<_> = local::run(4, Some(Duration::from_secs(20)), |mut c| {
            steps(&mut c, codec, strategy, None, n)
        })
        .into_iter()
        .map(Result::unwrap)
        .collect();
        let (dir, name) = place("flat");
        let o = options(&dir, 1024, 20_000);
        let got: Vec<_> = on_host(4, &[0, 1, 2, 3], &o, &name, |t| {
            steps(&mut Comm::new(t), codec, strategy, None, n)
        })
        .into_iter()
        .map(Result::unwrap)
        .collect();
        assert_eq!(bits(&got), bits(&want), "{codec}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// Three steps of the two-level int8 all-reduce on every rank of `nodes`, each host's
/// ranks (a node each) through shared memory made with `o`, the rest in process. Rank
/// `gone`, if given, leaves as soon as its transport is made (it returns no steps).
fn two_levels_on_hosts(
    nodes: &Nodes,
    n: usize,
    o: &SharedMemoryOptions,
    name: &str,
    gone: Option<usize>,
) -> Vec<gradpack::Result<Vec<Vec<f32>>>> {
    let world = nodes.world();
    std::thread::scope(|s| {
        let hs: Vec<_> = local::Local::world(world)
            .into_iter()
            .enumerate()
            .map(|(r, base)| {
                s.spawn(move || {
                    let host = nodes.members(nodes.node_of(r));
                    let shm = SharedMemory::open(name, r, world, host, o.clone())?;
                    assert!(shm.serves(host[0]) == (host[0] != r));
                    let mut routed = Routed::new(base, Some(shm))?;
                    assert_eq!(routed.node_memory().is_some(), o.stage > 0);
                    if gone == Some(r) {
                        return Ok(Vec::new());
                    }
                    // Odd ranks reach the collectives through a reference to their
                    // transport, which must keep its stage.
                    if r % 2 == 1 {
                        let mut comm = Comm::new(&mut routed);
                        assert_eq!(comm.transport().node_memory().is_some(), o.stage > 0);
                        steps(&mut comm, "int8", Strategy::CompressedRing, Some(nodes), n)
                    } else {
                        let mut comm = Comm::new(routed);
                        steps(&mut comm, "int8", Strategy::CompressedRing, Some(nodes), n)
                    }
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn two_levels_over_routed_shared_memory_give_the_in_process_bits() {
    // Nodes of unequal size: ranks 0, 1, 2 on one host, 3 and 4 on another; messages
    // inside a node through the rings, or (with a stage) no messages inside a node at
    // all: the stage is reduced in place, in rounds of a stage far smaller than the
    // tensor (64 values: 21 per shard) or one round of a large one.
    let nodes = Nodes::new(vec![0, 0, 0, 1, 1]).unwrap();
    let n = 4099;
    let want: Vec<_> = local::run(5, Some(Duration::from_secs(20)), |mut c| {
        steps(&mut c, "int8", Strategy::CompressedRing, Some(&nodes), n)
    })
    .into_iter()
    .map(Result::unwrap)
    .collect();
    for stage in [0, 256, 1 << 16] {
        let (dir, name) = place("routed");
        let o = SharedMemoryOptions {
            stage,
            ..options(&dir, 512, 20_000)
        };
        let got: Vec<_> = two_levels_on_hosts(&nodes, n, &o, &name, None)
            .into_iter()
            .map(Result::unwrap)
            .collect();
        assert_eq!(bits(&got), bits(&want), "stage {stage}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// Two two-level all-reduces of different lengths and a flat int8 ring, taking turns
/// (A, B, C, A per step), each with its own `comm`; the results in order.
fn turns<T: Transport>(comms: &mut [Comm<T>; 3], nodes: &Nodes) -> gradpack::Result<Vec<Vec<f32>>> {
    let o = ar_opts(Strategy::CompressedRing, Feedback::WorkerAndOwner);
    let (na, nb, nc) = (4099, 777, 3001);
    let [ca, cb, cc] = comms;
    let rank = ca.transport().rank();
    let mut a = Hierarchical::new(
        spec("int8"),
        spec("identity"),
        na,
        ca,
        nodes.clone(),
        o.clone(),
    )?;
    let mut b = Hierarchical::new(
        spec("identity"),
        spec("identity"),
        nb,
        cb,
        nodes.clone(),
        o.clone(),
    )?;
    let mut c = AllReduce::new(spec("int8"), nc, cc, o)?;
    let mut outs = Vec::new();
    for s in 0..3 {
        for (k, n) in [(0, na), (1, nb), (2, nc), (0, na)] {
            let mut out = vec![f32::NAN; n];
            let x = input(rank, n, s * 10 + k as u64);
            match k {
                0 => a.run(ca, &x, &mut out, 7 + s)?,
                1 => b.run(cb, &x, &mut out, 7 + s)?,
                _ => c.run(cc, &x, &mut out, 7 + s)?,
            };
            outs.push(out);
        }
    }
    Ok(outs)
}

#[test]
fn collectives_sharing_one_shared_memory_take_turns_with_the_in_process_bits() {
    // Each rank maps one set of rings and one stage (in rounds: 64 values) that three
    // collectives share, each with a transport of its own for the other host.
    let nodes = Nodes::new(vec![0, 0, 0, 1, 1]).unwrap();
    let world = nodes.world();
    let run = |stage: Option<usize>, by_rank: Vec<Vec<local::Local>>| {
        let (dir, name) = place("turns");
        let o = SharedMemoryOptions {
            stage: stage.unwrap_or(0),
            ..options(&dir, 512, 20_000)
        };
        let got: Vec<_> = std::thread::scope(|s| {
            let hs: Vec<_> = by_rank
                .into_iter()
                .enumerate()
                .map(|(r, ts)| {
                    let (nodes, o, name) = (&nodes, &o, &name);
                    s.spawn(move || {
                        let shm = match stage {
                            Some(_) => {
                                let host = nodes.members(nodes.node_of(r));
                                Some(std::sync::Arc::new(SharedMemory::open(
                                    name,
                                    r,
                                    world,
                                    host,
                                    o.clone(),
                                )?))
                            }
                            None => None,
                        };
                        let mut ts = ts.into_iter();
                        let mut comm = || -> gradpack::Result<_> {
                            Ok(Comm::new(Routed::sharing(ts.next().unwrap(), shm.clone())?))
                        };
                        let mut comms = [comm()?, comm()?, comm()?];
                        turns(&mut comms, nodes)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap().unwrap()).collect()
        });
        std::fs::remove_dir_all(&dir).unwrap();
        got
    };
    // Three in-process worlds: rank r's transport of each.
    let fresh = || -> Vec<Vec<local::Local>> {
        let bases: Vec<Vec<local::Local>> = (0..3).map(|_| local::Local::world(world)).collect();
        let mut by_rank: Vec<Vec<local::Local>> = (0..world).map(|_| Vec::new()).collect();
        for w in bases {
            for (r, t) in w.into_iter().enumerate() {
                by_rank[r].push(t);
            }
        }
        by_rank
    };
    // Without shared memory: the in-process transports alone.
    let want = run(None, fresh());
    for stage in [256, 1 << 16] {
        let got = run(Some(stage), fresh());
        assert_eq!(bits(&got), bits(&want), "stage {stage}");
    }
}

#[test]
fn a_rank_gone_from_a_node_stage_is_an_error_on_the_others() {
    // Rank 2 leaves before the all-reduce: its node's ranks fail at the stage's first
    // barrier (no heartbeat), within seconds, not after the 60 s timeout.
    let nodes = Nodes::new(vec![0, 0, 0]).unwrap();
    let (dir, name) = place("stagegone");
    let o = SharedMemoryOptions {
        stage: 1024,
        ..options(&dir, 512, 60_000)
    };
    let t0 = Instant::now();
    let got = two_levels_on_hosts(&nodes, 100, &o, &name, Some(2));
    for e in got.into_iter().take(2) {
        assert!(matches!(e, Err(Error::Transport { peer: 2, .. })), "{e:?}");
    }
    assert!(t0.elapsed() < Duration::from_secs(15));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Rank 1 of two does `peer` with its transport; rank 0 receives from it: the error and
/// how long it took to come.
fn first_recv_error(
    o: &SharedMemoryOptions,
    name: &str,
    peer: impl Fn(SharedMemory) + Sync,
) -> (Error, Duration) {
    let got = on_host(2, &[0, 1], o, name, |mut t| {
        if t.rank() == 1 {
            peer(t);
            return Ok(None);
        }
        let t0 = Instant::now();
        let e = t.recv(&mut Vec::new(), 1, usize::MAX).unwrap_err();
        Ok(Some((e, t0.elapsed())))
    });
    got.into_iter().next().unwrap().unwrap().unwrap()
}

#[test]
fn a_silent_peer_is_an_error_naming_it_within_the_timeout() {
    let (dir, name) = place("silent");
    let (e, took) = first_recv_error(&options(&dir, 256, 300), &name, |_t| {
        std::thread::sleep(Duration::from_millis(1200));
    });
    assert!(matches!(e, Error::Transport { peer: 1, .. }), "{e}");
    assert!(took < Duration::from_secs(1), "{took:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_reader_that_never_reads_fails_the_next_send() {
    let (dir, name) = place("unread");
    let o = options(&dir, 256, 300);
    let got = on_host(2, &[0, 1], &o, &name, |mut t| {
        if t.rank() == 1 {
            std::thread::sleep(Duration::from_millis(1500));
            return Ok(None);
        }
        t.send(&[7u8; 10_000], 1)?; // queued: the ring holds 256
        std::thread::sleep(Duration::from_millis(900));
        Ok(Some(t.send(&[1], 1).unwrap_err()))
    });
    let e = got.into_iter().next().unwrap().unwrap().unwrap();
    assert!(matches!(e, Error::Transport { peer: 1, .. }), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_missing_peer_is_an_error_at_set_up() {
    let (dir, name) = place("missing");
    let t0 = Instant::now();
    let e = SharedMemory::open(&name, 0, 2, &[0, 1], options(&dir, 256, 200)).unwrap_err();
    assert!(matches!(e, Error::Transport { peer: 1, .. }), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(2));
    // Its own file is removed when the failed set-up drops it.
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_arguments_are_errors() {
    let (dir, name) = place("args");
    let o = |cap| options(&dir, cap, 100);
    for (nm, rank, size, host, cap) in [
        ("", 0, 2, vec![0, 1], 256),
        ("a/b", 0, 2, vec![0, 1], 256),
        (name.as_str(), 2, 2, vec![0, 1], 256),
        (name.as_str(), 0, 2, vec![1], 256),
        (name.as_str(), 0, 2, vec![0, 0, 1], 256),
        (name.as_str(), 0, 2, vec![0, 5], 256),
        (name.as_str(), 0, 2, vec![0, 1], 100),
        (name.as_str(), 0, 2, vec![0, 1], 0),
    ] {
        assert!(
            SharedMemory::open(nm, rank, size, &host, o(cap)).is_err(),
            "{nm:?} {rank} {size} {host:?} {cap}"
        );
    }
    // A lone rank: nothing to map; messages to anyone are errors.
    let mut t = SharedMemory::open(&name, 1, 3, &[1], o(256)).unwrap();
    assert!(!t.serves(0) && !t.serves(1));
    assert!(matches!(
        t.send(&[1], 0),
        Err(Error::Transport { peer: 0, .. })
    ));
    assert!(t.send(&[1], 9).is_err());
    assert!(t.recv(&mut Vec::new(), 1, usize::MAX).is_err());
    drop(t);
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
    // A transport of another world size cannot be routed with it.
    let shm = SharedMemory::open(&name, 0, 3, &[0], o(256)).unwrap();
    let base = local::Local::world(2).into_iter().next().unwrap();
    assert!(Routed::new(base, Some(shm)).is_err());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn dropping_a_transport_delivers_what_it_queued() {
    let (dir, name) = place("drop");
    let o = options(&dir, 256, 20_000);
    let got = on_host(2, &[0, 1], &o, &name, |mut t| {
        if t.rank() == 1 {
            t.send(&message(1, 0, 0, 100_000), 0)?; // far larger than the ring
            return Ok(None); // dropped at once
        }
        std::thread::sleep(Duration::from_millis(200));
        let mut buf = Vec::new();
        t.recv(&mut buf, 1, usize::MAX)?;
        Ok(Some(buf))
    });
    let mut it = got.into_iter();
    assert_eq!(
        it.next().unwrap().unwrap().unwrap(),
        message(1, 0, 0, 100_000)
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_peer_that_is_gone_is_noticed_before_the_timeout() {
    // Rank 1 drops its transport without sending: its heartbeat stops, and rank 0's
    // receive fails within a few seconds, not after the 60 s timeout.
    let (dir, name) = place("gone");
    let (e, took) = first_recv_error(&options(&dir, 256, 60_000), &name, drop);
    assert!(matches!(e, Error::Transport { peer: 1, .. }), "{e}");
    assert!(took < Duration::from_secs(10), "{took:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_message_longer_than_the_receive_allows_is_refused_and_passed_over() {
    // Rank 1 sends 1 MiB through a 4 KiB ring, then a small message. Rank 0 receives the
    // first with room for 1000 bytes: refused at its length, nothing allocated for it;
    // the next receive passes over its bytes and gets the small message whole.
    let (dir, name) = place("long");
    let o = options(&dir, 4096, 20_000);
    let got = on_host(2, &[0, 1], &o, &name, |mut t| {
        if t.rank() == 1 {
            t.send(&message(1, 0, 0, 1 << 20), 0)?;
            t.send(&message(1, 0, 1, 300), 0)?;
            return Ok(None);
        }
        let mut buf = Vec::new();
        let e = t.recv(&mut buf, 1, 1000).unwrap_err();
        assert!(
            matches!(e, Error::MessageTooLong { peer: 1, len, max: 1000 } if len == 1 << 20),
            "{e}"
        );
        assert_eq!(
            buf.capacity(),
            0,
            "nothing allocated for the refused message"
        );
        t.recv(&mut buf, 1, 1000)?;
        Ok(Some(buf))
    });
    let mut it = got.into_iter();
    assert_eq!(it.next().unwrap().unwrap().unwrap(), message(1, 0, 1, 300));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_in_process_transport_refuses_a_message_longer_than_the_receive_allows() {
    let mut w = local::Local::world(2);
    let (mut b, mut a) = (w.pop().unwrap(), w.pop().unwrap());
    b.send(&[7; 100], 0).unwrap();
    b.send(&[8; 10], 0).unwrap();
    let mut buf = Vec::new();
    let e = a.recv(&mut buf, 1, 99).unwrap_err();
    assert!(
        matches!(
            e,
            Error::MessageTooLong {
                peer: 1,
                len: 100,
                max: 99
            }
        ),
        "{e}"
    );
    a.recv(&mut buf, 1, 10).unwrap();
    assert_eq!(buf, [8; 10]);
}

#[test]
fn two_jobs_that_use_one_name_fail_at_set_up_and_never_pair() {
    // Job 1's rank 0 publishes its file and waits; job 2's ranks start meanwhile with
    // the same name, then job 1's rank 1. No rank may end up paired with a rank of the
    // other job: a set-up either fails, or every message it exchanges is its own job's.
    let (dir, name) = place("twojobs");
    let jobs = [(1u64, 0usize, 0u64), (1, 1, 1000), (2, 0, 400), (2, 1, 400)];
    let got: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = jobs
            .iter()
            .map(|&(job, rank, delay)| {
                let o = SharedMemoryOptions {
                    job,
                    ..options(&dir, 256, 4000)
                };
                let name = &name;
                s.spawn(move || {
                    std::thread::sleep(Duration::from_millis(delay));
                    let mut t = SharedMemory::open(name, rank, 2, &[0, 1], o)?;
                    t.send(&job.to_le_bytes(), 1 - rank)?;
                    let mut buf = Vec::new();
                    t.recv(&mut buf, 1 - rank, 8)?;
                    Ok::<_, Error>(u64::from_le_bytes(buf[..8].try_into().unwrap()))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (&(job, rank, _), r) in jobs.iter().zip(&got) {
        if let Ok(peer_job) = r {
            assert_eq!(
                *peer_job, job,
                "job {job} rank {rank} paired with job {peer_job}"
            );
        }
    }
    let errors: Vec<String> = got
        .iter()
        .filter_map(|r| r.as_ref().err().map(|e| e.to_string()))
        .collect();
    assert!(errors.len() >= 2, "{got:?}");
    assert!(
        errors
            .iter()
            .any(|e| e.contains("exists already") || e.contains("job")),
        "{errors:?}"
    );
    assert_eq!(
        std::fs::read_dir(&dir).unwrap().count(),
        0,
        "files left behind"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[cfg(unix)]
#[test]
fn a_peer_file_of_another_user_is_refused() {
    // A file with the peer's name and the right size, owned by another user.
    let (dir, name) = place("user");
    let o = options(&dir, 256, 2000);
    let len = 128 + (128 + 256);
    let peer = dir.join(format!("gradpack-{name}-1"));
    std::fs::write(&peer, vec![0u8; len]).unwrap();
    if std::os::unix::fs::chown(&peer, Some(65534), Some(65534)).is_err() {
        println!("SKIP: cannot give a file to another user here (not root)");
        return;
    }
    let e = SharedMemory::open(&name, 0, 2, &[0, 1], o).unwrap_err();
    assert!(e.to_string().contains("another user"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn files_that_dead_set_ups_left_behind_are_swept() {
    // A process that is gone, as a rank killed while it set up leaves it: its published
    // file (last alive long ago) and its temporary file.
    let (dir, name) = place("sweep");
    let mut child = std::process::Command::new("true").spawn().unwrap();
    child.wait().unwrap();
    let dead = u64::from(child.id());
    let mut head = vec![0u8; 128 + (128 + 256)];
    head[0..8].copy_from_slice(b"GPSHM\0\0\x02");
    head[72..80].copy_from_slice(&dead.to_le_bytes());
    let old = dir.join("gradpack-killedjob-3");
    std::fs::write(&old, &head).unwrap();
    let tmp = dir.join(format!("gradpack-killedjob-4.making-{dead}"));
    std::fs::write(&tmp, &head).unwrap();
    // A file of a live process (this one) stays.
    head[72..80].copy_from_slice(&u64::from(std::process::id()).to_le_bytes());
    let live = dir.join("gradpack-livejob-0");
    std::fs::write(&live, &head).unwrap();
    let got = on_host(2, &[0, 1], &options(&dir, 256, 5000), &name, |_| Ok(()));
    assert!(got.iter().all(Result::is_ok), "{got:?}");
    let left: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(left, ["gradpack-livejob-0"]);
    std::fs::remove_dir_all(&dir).unwrap();
}

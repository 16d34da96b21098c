//! Faults injected from outside, one process per rank over shared memory: a rank held at
//! a chosen point of a call (before a write into its stage, before and halfway through a
//! copy out of a stage, at a barrier, before a message) for longer than the timeout, or a
//! rank whose call is refused for a bad argument, on the flat all-reduce, the two-level
//! all-reduce by frames, and the two-level all-reduce in place through the stages.
//!
//! Every call's result on every rank is compared with the same calls run in-process
//! without a fault: every `Ok` must hold those bits exactly (never a wrong `Ok`), the
//! fault must be noticed (some call fails somewhere), and the world must be back in step
//! (the last two calls `Ok` on every rank).
//!
//! A test binary without libtest's harness: run with no arguments it is the launcher,
//! and it starts copies of itself as the ranks (`GRADPACK_HELD_ROLE` set), each held
//! through `GRADPACK_HOLD`. Arguments that do not start with `-` filter scenarios by
//! name.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use gradpack::collective::{
    AllReduce, AllReduceOptions, Comm, Feedback, Hierarchical, Nodes, SharedMemory,
    SharedMemoryOptions, Strategy, StrategyChoice, Tcp, TcpOptions, Transport, local,
};
use gradpack::{CodecSpec, Result};

/// Calls each rank makes; the fault is in call [`FAULT_CALL`].
const CALLS: u64 = 10;
const FAULT_CALL: u64 = 2;
/// Elements per tensor, and the stage: 1000 values in shards of 500, 128 values of a
/// shard per round with two shards (four rounds), 64 with four.
const N: usize = 1000;
const STAGE: usize = 1024;
/// The transports' timeout, and how long a held rank sleeps: past three timeouts, so
/// that its peers give up on the call and on the next ones while it is held (its
/// heartbeat goes on: it is alive, only slow).
const TIMEOUT: Duration = Duration::from_millis(1000);
const HOLD_MS: u64 = 3500;

#[derive(Debug, Clone, Copy, PartialEq)]
enum Path2 {
    /// `AllReduce` over the world.
    Flat,
    /// `Hierarchical`, frames inside the node.
    Frames,
    /// `Hierarchical` in place through the stages.
    Stage,
}

#[derive(Debug, Clone)]
enum Fault {
    /// A rank held at a point of call [`FAULT_CALL`] for [`HOLD_MS`]: `(rank, point,
    /// index)` (see `GRADPACK_HOLD`).
    Hold(usize, &'static str, u64),
    /// Holds of any length in any calls: `(rank, point, call, index, ms)`.
    Holds(&'static [(usize, &'static str, u64, u64, u64)]),
    /// This rank's call [`FAULT_CALL`] passes one value too many.
    BadLength(usize),
    /// This rank leaves before call [`FAULT_CALL`] (drops its transport and ends).
    Leave(usize),
}

#[derive(Debug, Clone)]
struct Scenario {
    name: String,
    /// Over [`gradpack::collective::Tcp`] instead of shared memory.
    tcp: bool,
    path: Path2,
    world: usize,
    per_node: usize,
    fault: Fault,
}

fn scenarios() -> Vec<Scenario> {
    let mut v = Vec::new();
    let mut add_on = |tcp: bool, path, world, per_node, fault: Fault| {
        let what = match &fault {
            Fault::Hold(r, p, i) => format!("rank {r} held at {p} {i}"),
            Fault::Holds(h) => h
                .iter()
                .map(|(r, p, c, i, ms)| format!("rank {r} held at {p} {i} of call {c} {ms} ms"))
                .collect::<Vec<_>>()
                .join(", "),
            Fault::BadLength(r) => format!("rank {r} refused for a bad length"),
            Fault::Leave(r) => format!("rank {r} leaves"),
        };
        let over = if tcp { " over TCP" } else { "" };
        v.push(Scenario {
            name: format!("{path:?}{over} {world} ranks, {per_node} a node: {what}"),
            tcp,
            path,
            world,
            per_node,
            fault,
        });
    };
    let mut add = |path, world, per_node, fault| add_on(false, path, world, per_node, fault);
    // One node of two ranks in place: four rounds, so reads 0..7 are the owners' sums
    // and 8..15 the copies into the output (even ones out of rank 0's stage, odd ones out
    // of rank 1's); barriers 0..7 and 8..15 likewise.
    for (point, i) in [
        ("stage-write", 0),
        ("stage-read", 1),
        ("stage-copy", 6),
        ("barrier", 3),
        ("stage-read", 8),
        ("stage-copy", 14),
        ("stage-copy", 15),
        ("barrier", 14),
        ("barrier", 15),
    ] {
        add(Path2::Stage, 2, 2, Fault::Hold(1, point, i));
    }
    add(Path2::Stage, 2, 2, Fault::Hold(0, "stage-copy", 15));
    // Rank 1 held in its last copy out of rank 0's stage while rank 0 gives up on the
    // call and the next, then pauses before its call after that: rank 1 comes back to
    // rank 0's stage and barrier word as its next call left them.
    add(
        Path2::Stage,
        2,
        2,
        Fault::Holds(&[
            (1, "stage-copy", FAULT_CALL, 14, HOLD_MS),
            (0, "stage-write", FAULT_CALL + 2, 0, HOLD_MS),
        ]),
    );
    add(Path2::Stage, 2, 2, Fault::BadLength(1));
    // Two nodes of two ranks in place: the copies into the output, a barrier, and the
    // step between nodes.
    add(Path2::Stage, 4, 2, Fault::Hold(3, "stage-copy", 15));
    add(Path2::Stage, 4, 2, Fault::Hold(2, "barrier", 9));
    add(Path2::Stage, 4, 2, Fault::Hold(1, "send", 3));
    add(Path2::Stage, 4, 2, Fault::BadLength(2));
    // Two nodes of two ranks by frames, and the flat all-reduce of four ranks.
    add(Path2::Frames, 4, 2, Fault::Hold(1, "recv", 0));
    add(Path2::Frames, 4, 2, Fault::Hold(2, "send", 1));
    add(Path2::Frames, 4, 2, Fault::BadLength(3));
    add(Path2::Flat, 4, 4, Fault::Hold(1, "recv", 2));
    add(Path2::Flat, 4, 4, Fault::BadLength(0));
    // Over TCP: the flat all-reduce and the two-level one by frames, held, refused, and
    // a rank that leaves.
    add_on(true, Path2::Flat, 4, 4, Fault::Hold(2, "send", 3));
    add_on(true, Path2::Flat, 3, 3, Fault::BadLength(1));
    add_on(true, Path2::Frames, 4, 2, Fault::Hold(1, "recv", 0));
    add_on(true, Path2::Flat, 4, 4, Fault::Leave(3));
    add_on(true, Path2::Frames, 4, 2, Fault::Leave(0));
    v
}

fn codec() -> CodecSpec {
    "int8".parse().expect("a valid spec")
}

fn options() -> AllReduceOptions {
    AllReduceOptions {
        strategy: StrategyChoice::Forced(Strategy::CompressedRing),
        feedback: Feedback::None,
        ..Default::default()
    }
}

fn input(rank: usize, call: u64) -> Vec<f32> {
    (0..N)
        .map(|i| {
            let x = (i as u64 * 2654435761 + rank as u64 * 97 + call * 7919) % 10007;
            (x as f32 / 10007.0 - 0.5) * (1.0 + rank as f32)
        })
        .collect()
}

/// One collective of a scenario, whichever path.
enum Collective {
    Flat(AllReduce),
    Two(Hierarchical),
}

impl Collective {
    fn new<T: Transport>(s: &Scenario, t: &T) -> Result<Collective> {
        Ok(match s.path {
            Path2::Flat => Collective::Flat(AllReduce::new(codec(), N, t, options())?),
            Path2::Frames | Path2::Stage => Collective::Two(Hierarchical::new(
                codec(),
                "identity".parse::<CodecSpec>().expect("valid"),
                N,
                t,
                Nodes::uniform(s.world, s.per_node)?,
                options(),
            )?),
        })
    }

    /// Call `call` of rank `rank`: its result, or the error.
    fn call<T: Transport>(
        &mut self,
        comm: &mut Comm<T>,
        s: &Scenario,
        rank: usize,
        call: u64,
    ) -> Result<Vec<f32>> {
        let mut data = input(rank, call);
        if call == FAULT_CALL && matches!(s.fault, Fault::BadLength(r) if r == rank) {
            data.push(0.0);
        }
        let seed = 1000 + call;
        match self {
            Collective::Flat(ar) => {
                let mut out = vec![f32::NAN; data.len()];
                ar.run(comm, &data, &mut out, seed).map(|_| out)
            }
            Collective::Two(h) => h.run_in_place(comm, &mut data, seed).map(|_| data),
        }
    }
}

/// A rank: set up the shared memory, make every call, write each result (or the error)
/// to `out`.
fn rank_main(role: &str) -> std::result::Result<(), String> {
    let f: Vec<&str> = role.split(';').collect();
    let [index, rank, name, dir, out, master] = f[..] else {
        return Err(format!("bad role {role:?}"));
    };
    let s = &scenarios()[index.parse::<usize>().map_err(|e| e.to_string())?];
    let rank: usize = rank
        .parse()
        .map_err(|e: std::num::ParseIntError| e.to_string())?;
    let host: Vec<usize> = (0..s.world).collect();
    let opts = SharedMemoryOptions {
        capacity: 1 << 16,
        timeout: TIMEOUT,
        dir: Some(PathBuf::from(dir)),
        stage: if s.path == Path2::Stage { STAGE } else { 0 },
        job: 0x5eed,
    };
    let bytes = if s.tcp {
        let master = master.parse().map_err(|e| format!("{master}: {e}"))?;
        let o = TcpOptions {
            timeout: TIMEOUT,
            interface: None,
        };
        let t = Tcp::rendezvous(master, rank, s.world, o).map_err(|e| e.to_string())?;
        calls(s, rank, t)?
    } else {
        let shm =
            SharedMemory::open(name, rank, s.world, &host, opts).map_err(|e| e.to_string())?;
        calls(s, rank, shm)?
    };
    std::fs::write(out, bytes).map_err(|e| e.to_string())
}

/// Every call of rank `rank` over transport `t`: per call, 1 and the result's bits, 0
/// for an error, or 2 once the rank has left.
fn calls<T: Transport>(s: &Scenario, rank: usize, t: T) -> std::result::Result<Vec<u8>, String> {
    let mut c = Collective::new(s, &t).map_err(|e| e.to_string())?;
    let mut comm = Comm::new(t);
    let mut bytes = Vec::new();
    for call in 0..CALLS {
        if call == FAULT_CALL && matches!(s.fault, Fault::Leave(r) if r == rank) {
            drop(comm);
            bytes.resize(bytes.len() + (CALLS - call) as usize, 2);
            return Ok(bytes);
        }
        match c.call(&mut comm, s, rank, call) {
            Ok(v) => {
                bytes.push(1u8);
                v.iter()
                    .for_each(|x| bytes.extend(x.to_bits().to_le_bytes()));
            }
            Err(e) => {
                eprintln!("rank {rank} call {call}: {e}");
                bytes.push(0u8);
            }
        }
    }
    Ok(bytes)
}

/// The results of the fault-free calls, in-process: per rank, per call.
fn reference(s: &Scenario) -> Vec<Vec<Vec<f32>>> {
    local::run(s.world, Some(Duration::from_secs(60)), |t| {
        let rank = t.rank();
        let mut c = Collective::new(s, &t)?;
        let mut comm = t;
        let clean = Scenario {
            fault: Fault::BadLength(usize::MAX),
            ..s.clone()
        };
        (0..CALLS)
            .map(|call| c.call(&mut comm, &clean, rank, call))
            .collect()
    })
    .into_iter()
    .map(|r| r.expect("the fault-free run"))
    .collect()
}

fn run(index: usize, s: &Scenario, dir: &Path) -> std::result::Result<(), String> {
    let want = reference(s);
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let name = format!("held{}-{index}", std::process::id());
    let master = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| e.to_string())?;
    let started = Instant::now();
    let children: Vec<_> = (0..s.world)
        .map(|r| {
            let out = dir.join(format!("{name}-rank{r}"));
            let mut cmd = Command::new(&exe);
            cmd.env(
                "GRADPACK_HELD_ROLE",
                format!(
                    "{index};{r};{name};{};{};{master}",
                    dir.display(),
                    out.display()
                ),
            )
            .env_remove("GRADPACK_HOLD")
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
            match s.fault {
                Fault::Hold(who, point, i) => {
                    cmd.env(
                        "GRADPACK_HOLD",
                        format!("{who}:{point}:{FAULT_CALL}:{i}:{HOLD_MS}"),
                    );
                }
                Fault::Holds(h) => {
                    let list: Vec<_> = h
                        .iter()
                        .map(|(r, p, c, i, ms)| format!("{r}:{p}:{c}:{i}:{ms}"))
                        .collect();
                    cmd.env("GRADPACK_HOLD", list.join(","));
                }
                Fault::BadLength(_) | Fault::Leave(_) => {}
            }
            cmd.spawn().map(|c| (c, out)).map_err(|e| e.to_string())
        })
        .collect::<std::result::Result<_, _>>()?;
    let mut errors = 0;
    let mut log = String::new();
    let mut got = Vec::new();
    for (child, out) in children {
        let o = child.wait_with_output().map_err(|e| e.to_string())?;
        log.push_str(&String::from_utf8_lossy(&o.stderr));
        if !o.status.success() {
            return Err(format!("a rank exited with {}: {log}", o.status));
        }
        got.push(std::fs::read(&out).map_err(|e| format!("{}: {e}", out.display()))?);
        let _ = std::fs::remove_file(&out);
    }
    let left = matches!(s.fault, Fault::Leave(_));
    for (r, bytes) in got.iter().enumerate() {
        let mut at = 0;
        for (call, want) in want[r].iter().enumerate() {
            let status = bytes.get(at).copied();
            at += 1;
            if status == Some(2) {
                continue;
            }
            if status == Some(1) {
                let v: Vec<u32> = bytes[at..at + 4 * N]
                    .chunks_exact(4)
                    .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")))
                    .collect();
                at += 4 * N;
                let w: Vec<u32> = want.iter().map(|x| x.to_bits()).collect();
                if v != w {
                    return Err(format!(
                        "rank {r} call {call} returned Ok with a wrong sum\n{log}"
                    ));
                }
            } else {
                errors += 1;
                if call + 2 >= CALLS as usize && !left {
                    return Err(format!("rank {r} call {call} still fails\n{log}"));
                }
            }
            if left && status == Some(1) && call as u64 > FAULT_CALL {
                return Err(format!(
                    "rank {r} call {call}: Ok without the rank that left\n{log}"
                ));
            }
        }
    }
    if errors == 0 {
        return Err("the fault went unnoticed: every call Ok on every rank".into());
    }
    let left: Vec<_> = std::fs::read_dir(dir)
        .map_err(|e| e.to_string())?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|f| f.contains(&name))
        .collect();
    if !left.is_empty() {
        return Err(format!("files left behind: {left:?}"));
    }
    println!(
        "ok: {} ({errors} calls failed, {:.1} s)",
        s.name,
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

fn main() {
    if let Ok(role) = std::env::var("GRADPACK_HELD_ROLE") {
        if let Err(e) = rank_main(&role) {
            eprintln!("{e}");
            std::process::exit(1);
        }
        return;
    }
    if !cfg!(all(unix, target_arch = "x86_64")) {
        // Under qemu-user a rank started as a process would not run under the emulator.
        println!("SKIP: the held-rank scenarios run on x86-64 hosts only");
        println!("0 passed, 0 failed");
        return;
    }
    let filters: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let all = scenarios();
    let chosen: Vec<(usize, &Scenario)> = all
        .iter()
        .enumerate()
        .filter(|(_, s)| filters.is_empty() || filters.iter().any(|f| s.name.contains(f.as_str())))
        .collect();
    let dir = std::env::temp_dir().join(format!("gradpack-held-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a directory for the ranks' files");
    // Three scenarios at a time: most of a scenario is a held rank asleep.
    let results: Vec<(String, std::result::Result<(), String>)> = chosen
        .chunks(3)
        .flat_map(|group| {
            std::thread::scope(|sc| {
                let hs: Vec<_> = group
                    .iter()
                    .map(|&(i, s)| {
                        let dir = &dir;
                        sc.spawn(move || (s.name.clone(), run(i, s, dir)))
                    })
                    .collect();
                hs.into_iter()
                    .map(|h| h.join().expect("a scenario thread"))
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let _ = std::fs::remove_dir_all(&dir);
    let failed: Vec<_> = results.iter().filter(|(_, r)| r.is_err()).collect();
    for (name, r) in &failed {
        println!("FAILED: {name}: {}", r.as_ref().expect_err("failed"));
    }
    println!(
        "{} passed, {} failed",
        results.len() - failed.len(),
        failed.len()
    );
    if !failed.is_empty() {
        std::process::exit(1);
    }
}

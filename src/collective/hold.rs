//! Held points of a collective call, for fault-injection tests: the environment variable
//! `GRADPACK_HOLD` makes this process sleep at chosen points of chosen calls, as a page
//! fault, a descheduled thread or a debugger would hold it.
//!
//! `GRADPACK_HOLD` is a comma-separated list of `RANK:POINT:CALL:INDEX:MS`: on rank
//! `RANK`, at the `INDEX`-th occurrence (from 0) of `POINT` in collective call `CALL` (the
//! call number of its `Comm`), sleep `MS` milliseconds, once. The points:
//!
//! | point | where | index |
//! |---|---|---|
//! | `send` | before a message is sent | the message's hop |
//! | `recv` | before a message is received | the message's hop |
//! | `stage-write` | before this rank writes into its stage (two-level, in place) | the call's writes, counted |
//! | `stage-read` | before this rank copies out of a stage | the call's copies, counted |
//! | `stage-copy` | halfway through such a copy | the call's copies, counted |
//! | `barrier` | before this rank enters a barrier of the node's stages | the barrier |
//!
//! Read once per process; a malformed list is reported on standard error once and
//! ignored. Unset (the normal case), a point costs one load of a static.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// A point of a call at which a rank can be held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Point {
    Send,
    Recv,
    StageWrite,
    StageRead,
    StageCopy,
    Barrier,
}

impl Point {
    fn parse(s: &str) -> Option<Point> {
        Some(match s {
            "send" => Point::Send,
            "recv" => Point::Recv,
            "stage-write" => Point::StageWrite,
            "stage-read" => Point::StageRead,
            "stage-copy" => Point::StageCopy,
            "barrier" => Point::Barrier,
            _ => return None,
        })
    }
}

#[derive(Debug)]
struct Rule {
    rank: usize,
    point: Point,
    call: u64,
    index: u64,
    hold: Duration,
    fired: AtomicBool,
}

fn parse(list: &str) -> Option<Vec<Rule>> {
    list.split(',')
        .filter(|s| !s.trim().is_empty())
        .map(|item| {
            let f: Vec<&str> = item.trim().split(':').collect();
            let [rank, point, call, index, ms] = f[..] else {
                return None;
            };
            Some(Rule {
                rank: rank.parse().ok()?,
                point: Point::parse(point)?,
                call: call.parse().ok()?,
                index: index.parse().ok()?,
                hold: Duration::from_millis(ms.parse().ok()?),
                fired: AtomicBool::new(false),
            })
        })
        .collect()
}

fn rules() -> &'static [Rule] {
    static RULES: OnceLock<Vec<Rule>> = OnceLock::new();
    RULES.get_or_init(|| match std::env::var("GRADPACK_HOLD") {
        Ok(list) => parse(&list).unwrap_or_else(|| {
            eprintln!(
                "gradpack: GRADPACK_HOLD={list:?} ignored: want RANK:POINT:CALL:INDEX:MS, \
                 comma-separated"
            );
            Vec::new()
        }),
        Err(_) => Vec::new(),
    })
}

/// Whether any hold is set for this process.
pub(crate) fn any() -> bool {
    !rules().is_empty()
}

/// Sleep here if a rule names this place (the first time only).
pub(crate) fn at(rank: usize, point: Point, call: u64, index: u64) {
    for r in rules() {
        if (r.rank, r.point, r.call, r.index) == (rank, point, call, index)
            && !r.fired.swap(true, Ordering::AcqRel)
        {
            std::thread::sleep(r.hold);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_parse_and_refuse_malformed_lists() {
        let r = parse("1:stage-copy:2:3:5000, 0:barrier:4:0:10").expect("valid");
        assert_eq!(r.len(), 2);
        assert_eq!(
            (r[0].rank, r[0].point, r[0].call, r[0].index),
            (1, Point::StageCopy, 2, 3)
        );
        assert_eq!(r[0].hold, Duration::from_secs(5));
        assert_eq!(r[1].point, Point::Barrier);
        for bad in [
            "1:copy:2:3:5",
            "1:send:2:3",
            "x:send:1:1:1",
            "1:send:1:1:1:1",
        ] {
            assert!(parse(bad).is_none(), "{bad}");
        }
        assert_eq!(parse("").map(|r| r.len()), Some(0));
    }
}

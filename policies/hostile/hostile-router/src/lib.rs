//! A hostile router for containment tests, never shipped. The requested model
//! picks the misbehaviour: `loop`, `oom`, `recurse`, `panic`, `huge` (a 1 MiB
//! reject message), `grow` (answers after growing memory by 10 MiB); any
//! other model is served locally as asked. Config `loop-always` makes every
//! call loop (so upload validation must time out); `loop-inputs` makes
//! `decision_inputs` loop (asked at upload, so that must time out too);
//! `fail-init` makes `init` fail; `oom-init` exhausts memory in `init`.

use std::hint::black_box;

use mlxgate_guest::router::*;

struct Hostile {
    loop_always: bool,
    loop_inputs: bool,
}

fn spin() -> ! {
    let mut n: u64 = 0;
    loop {
        n = black_box(n.wrapping_add(1));
    }
}

fn hog() -> usize {
    let mut chunks: Vec<Vec<u8>> = Vec::new();
    loop {
        // Reserve without touching: growth, not page-filling, is the point.
        let mut chunk = Vec::with_capacity(4 << 20);
        chunk.push(1u8);
        chunks.push(black_box(chunk));
        if chunks.len() == usize::MAX {
            return chunks.len();
        }
    }
}

/// Recursion through an opaque function pointer: no tail-call or loop
/// rewriting, and almost no shadow-stack use, so the Wasm stack overflows.
fn recurse(depth: u64) -> u64 {
    if depth == u64::MAX {
        return 0;
    }
    let next: fn(u64) -> u64 = black_box(recurse);
    next(depth + 1).wrapping_mul(3).wrapping_add(depth)
}

impl Router for Hostile {
    fn init(config: &str) -> Result<Self, String> {
        match config {
            "fail-init" => Err("refusing to start: fail-init".to_string()),
            "oom-init" => Ok(Hostile {
                loop_always: hog() == 0,
                loop_inputs: false,
            }),
            other => Ok(Hostile {
                loop_always: other == "loop-always",
                loop_inputs: other == "loop-inputs",
            }),
        }
    }

    fn route(&self, facts: &RequestFacts, _backends: &[BackendState]) -> RouteDecision {
        if self.loop_always {
            spin();
        }
        match facts.model {
            "loop" => spin(),
            "oom" => RouteDecision::Local(format!("{}", hog())),
            "recurse" => RouteDecision::Local(format!("{}", recurse(0))),
            "panic" => panic!("hostile guest panics on purpose"),
            "huge" => RouteDecision::reject(500, "x".repeat(1 << 20)),
            "grow" => {
                // Grows memory by 10 MiB, then frees it: a legal call that
                // leaves a large instance behind.
                let big: Vec<u8> = black_box(Vec::with_capacity(10 << 20));
                drop(big);
                RouteDecision::Local(facts.model.to_string())
            }
            _ => RouteDecision::Local(facts.model.to_string()),
        }
    }

    fn decision_inputs(&self) -> Option<FactSet> {
        if self.loop_inputs {
            spin();
        }
        None
    }
}

mlxgate_guest::export_router!(Hostile);

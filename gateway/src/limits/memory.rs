//! Counters kept in this process: one state per counter in one vector
//! behind one lock, so checking every counter of a request and taking the
//! request from all of them is a single short critical section.

use std::sync::Mutex;

use super::gcra::{self, State};
use super::{LimitError, MAX_COUNTERS, Plan, Quota, decide, now_us};

pub struct MemoryStore {
    states: Mutex<Vec<State>>,
}

impl MemoryStore {
    pub fn new(counters: usize) -> MemoryStore {
        MemoryStore {
            states: Mutex::new(vec![State::default(); counters]),
        }
    }

    pub fn admit(&self, plan: &Plan) -> Result<Quota, LimitError> {
        let now = now_us();
        let n = plan.counters.len();
        let mut states = self.states.lock().unwrap_or_else(|p| p.into_inner());
        let mut mine = of_plan(&states, plan);
        let tats = decide(plan, &mine[..n], now)?;
        for ((c, m), tat) in plan.counters.iter().zip(&mut mine).zip(tats) {
            m.request_tat = tat;
            states[c.slot].request_tat = tat;
        }
        drop(states);
        Ok(Quota::of(plan, &mine[..n], now))
    }

    pub fn peek(&self, plan: &Plan) -> Quota {
        let now = now_us();
        let states = self.states.lock().unwrap_or_else(|p| p.into_inner());
        let mine = of_plan(&states, plan);
        drop(states);
        Quota::of(plan, &mine[..plan.counters.len()], now)
    }

    /// Sets `counter`'s tokens of the day of `now` to `used`.
    pub fn restore_day(&self, counter: &super::Counter, used: u64, now: f64) {
        let mut states = self.states.lock().unwrap_or_else(|p| p.into_inner());
        let s = &mut states[counter.slot];
        s.day = gcra::day_of(now);
        s.day_tokens = used;
    }

    pub fn charge(&self, plan: &Plan, tokens: u64) {
        let now = now_us();
        let mut states = self.states.lock().unwrap_or_else(|p| p.into_inner());
        for c in &plan.counters {
            gcra::charge(&mut states[c.slot], &c.rates, tokens, now);
        }
    }
}

/// The states of `plan`'s counters, in its order (the first
/// `plan.counters.len()`), copied out of `states` without allocating.
fn of_plan(states: &[State], plan: &Plan) -> [State; MAX_COUNTERS] {
    let mut mine = [State::default(); MAX_COUNTERS];
    for (m, c) in mine.iter_mut().zip(&plan.counters) {
        *m = states[c.slot];
    }
    mine
}

//! The order in which waiting requests start: weighted-fair between
//! tenants (start-time fair queueing), first come first served within one.
//!
//! Each tenant's next request gets a virtual start time: the later of the
//! queue's clock and the tenant's last finish; taking it moves the clock
//! there and the tenant's finish on by `1 / weight`. A tenant that floods
//! the queue only moves its own finish ahead, so another tenant's request
//! starts after at most one of each other tenant's (per unit of weight), and
//! a tenant idle for a while gets no credit to burst with when it returns.
//! Higher priority classes go first; fairness holds within a class.

use std::collections::{BTreeMap, VecDeque};

pub struct FairQueue<T> {
    /// By (priority, tenant): a `BTreeMap` so ties break the same way
    /// every run.
    tenants: BTreeMap<(i8, Option<String>), Lane<T>>,
    clock: f64,
    len: usize,
}

struct Lane<T> {
    items: VecDeque<T>,
    weight: f64,
    finish: f64,
}

impl<T> Default for FairQueue<T> {
    fn default() -> Self {
        FairQueue {
            tenants: BTreeMap::new(),
            clock: 0.0,
            len: 0,
        }
    }
}

impl<T> FairQueue<T> {
    /// Queues `item` for `tenant` (weight at least 1) in `priority`'s class
    /// (higher first).
    pub fn push(&mut self, priority: i8, tenant: Option<&str>, weight: u32, item: T) {
        let lane = self
            .tenants
            .entry((priority, tenant.map(str::to_owned)))
            .or_insert_with(|| Lane {
                items: VecDeque::new(),
                weight: f64::from(weight.max(1)),
                finish: 0.0,
            });
        lane.weight = f64::from(weight.max(1));
        lane.items.push_back(item);
        self.len += 1;
    }

    /// The lane whose head goes next, and its virtual start.
    fn next(&self) -> Option<(&(i8, Option<String>), f64)> {
        let top = self
            .tenants
            .iter()
            .filter(|(_, lane)| !lane.items.is_empty())
            .map(|(k, _)| k.0)
            .max()?;
        self.tenants
            .iter()
            .filter(|(k, lane)| k.0 == top && !lane.items.is_empty())
            .map(|(k, lane)| (k, lane.finish.max(self.clock)))
            .min_by(|a, b| a.1.total_cmp(&b.1))
    }

    /// The item [`FairQueue::pop`] would take.
    pub fn peek(&self) -> Option<&T> {
        let (key, _) = self.next()?;
        self.tenants.get(key)?.items.front()
    }

    /// The next item in fair order.
    pub fn pop(&mut self) -> Option<T> {
        let (key, start) = self.next()?;
        let key = key.clone();
        let lane = self.tenants.get_mut(&key)?;
        let item = lane.items.pop_front()?;
        lane.finish = start + 1.0 / lane.weight;
        self.clock = start;
        self.len -= 1;
        self.prune();
        Some(item)
    }

    /// Drops lanes with nothing queued whose finish the clock has passed
    /// (they would start at the clock anyway).
    fn prune(&mut self) {
        let clock = self.clock;
        self.tenants
            .retain(|_, lane| !lane.items.is_empty() || lane.finish > clock);
        if self.len == 0 {
            self.tenants.clear();
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Keeps only the items `keep` accepts (drops cancelled requests).
    pub fn retain(&mut self, mut keep: impl FnMut(&T) -> bool) {
        for lane in self.tenants.values_mut() {
            lane.items.retain(&mut keep);
        }
        self.len = self.tenants.values().map(|l| l.items.len()).sum();
        self.prune();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drain(queue: &mut FairQueue<String>) -> Vec<String> {
        std::iter::from_fn(|| queue.pop()).collect()
    }

    #[test]
    fn a_flooding_tenant_does_not_starve_another() {
        let mut queue = FairQueue::default();
        for i in 0..100 {
            queue.push(0, Some("a"), 1, format!("a{i}"));
        }
        for i in 0..3 {
            queue.push(0, Some("b"), 1, format!("b{i}"));
        }
        let order = drain(&mut queue);
        let position = |name: &str| order.iter().position(|x| x == name).unwrap();
        // b's requests alternate with a's, not after all 100 of them.
        assert!(position("b0") <= 1, "{order:?}");
        assert!(position("b2") <= 5, "{order:?}");
        assert_eq!(order.len(), 103);
        assert!(queue.is_empty());
    }

    #[test]
    fn weights_give_proportional_turns_and_each_tenant_keeps_its_order() {
        let mut queue = FairQueue::default();
        for i in 0..30 {
            queue.push(0, Some("heavy"), 2, format!("h{i}"));
            queue.push(0, Some("light"), 1, format!("l{i}"));
        }
        let first: Vec<String> = (0..30).filter_map(|_| queue.pop()).collect();
        let heavy = first.iter().filter(|x| x.starts_with('h')).count();
        assert!((19..=21).contains(&heavy), "{heavy} of 30: {first:?}");
        let hs: Vec<&String> = first.iter().filter(|x| x.starts_with('h')).collect();
        assert_eq!(hs[0], "h0");
        assert_eq!(hs[1], "h1");
    }

    #[test]
    fn higher_priority_goes_first_and_an_idle_tenant_gets_no_burst_credit() {
        let mut queue = FairQueue::default();
        queue.push(0, Some("a"), 1, "a0".to_owned());
        queue.push(1, Some("b"), 1, "urgent".to_owned());
        assert_eq!(queue.peek().map(String::as_str), Some("urgent"));
        assert_eq!(queue.pop().as_deref(), Some("urgent"));
        assert_eq!(queue.pop().as_deref(), Some("a0"));
        // a ran alone for a while; b arriving later starts level with it.
        for i in 1..20 {
            queue.push(0, Some("a"), 1, format!("a{i}"));
        }
        for _ in 0..10 {
            queue.pop();
        }
        for i in 0..5 {
            queue.push(0, Some("c"), 1, format!("c{i}"));
        }
        let next: Vec<String> = (0..6).filter_map(|_| queue.pop()).collect();
        let cs = next.iter().filter(|x| x.starts_with('c')).count();
        assert_eq!(cs, 3, "c alternates with a, no more: {next:?}");
        queue.retain(|x| !x.starts_with('a'));
        assert_eq!(drain(&mut queue), vec!["c3", "c4"]);
    }
}

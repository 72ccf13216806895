//! Serving a model split over processes: rank 0 runs HTTP and the
//! scheduler, and every other rank is an `mlxgate worker` that takes the
//! same forward passes, in the same order, on its own slice of the model,
//! so that the all-sums inside them line up.
//!
//! Rank 0 (the [`Leader`]) listens on a control address. A worker connects,
//! says which rank it is ([`Frame::Hello`]) and waits; once every rank is
//! there, rank 0 tells them to form the ring ([`Frame::FormRing`]), and
//! each loads its slice and says [`Frame::Ready`]. From then on, before
//! every forward pass rank 0 sends its rows ([`Frame::Forward`]: each
//! sequence's cache id, position and tokens) and the caches it dropped.
//! One JSON object a line: a step is a few hundred bytes.
//!
//! A worker that exits closes its control connection, and its ring sockets
//! fail the collective in flight: rank 0 fails the requests in flight (5xx
//! in the API's shape), refuses new ones (503), reports not ready, and
//! closes the other workers' connections, which makes them exit. Starting
//! the workers again forms a new group and service resumes; rank 0 keeps
//! its weights. A worker that hangs without exiting (stopped, its host cut
//! off) stops sending its heartbeat ([`Frame::Heartbeat`], every
//! [`HEARTBEAT`]): after [`SILENCE`] rank 0 breaks the group the same way,
//! and shuts down its own ring sockets ([`super::sever`]) so that a step
//! waiting on that worker fails instead of waiting forever (MLX's ring has
//! no timeout of its own).

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::engine::model::{KvCache, Transformer};

/// The backend every rank forms its group on (CPUs: TCP).
const BACKEND: &str = "ring";

/// How often a worker says it is alive.
pub const HEARTBEAT: Duration = Duration::from_millis(500);

/// How long rank 0 waits on a worker's silence before breaking the group.
pub const SILENCE: Duration = Duration::from_secs(3);

/// What rank 0 and its workers say to each other: one JSON object a line.
#[derive(Serialize, Deserialize, Debug)]
#[serde(tag = "frame", rename_all = "snake_case")]
pub enum Frame {
    /// Worker to rank 0, first: which rank of how many it is.
    Hello { rank: usize, world: usize },
    /// Rank 0 to workers: every rank is here; form the ring now.
    FormRing,
    /// Worker to rank 0: its slice is loaded; steps may come.
    Ready,
    /// Worker to rank 0, every [`HEARTBEAT`] from its own thread: alive,
    /// whatever its main thread is doing.
    Heartbeat,
    /// Rank 0 to workers: forget the caches `dropped`, then run one
    /// forward pass of `rows` (all with the same number of tokens).
    Forward { rows: Vec<Row>, dropped: Vec<u64> },
    /// Either way: the sender cannot go on, and why.
    Failed { message: String },
}

/// One sequence of a forward pass: its cache, the cache's length before
/// the pass, and the tokens it takes in.
#[derive(Serialize, Deserialize, Debug)]
pub struct Row {
    pub cache: u64,
    pub offset: usize,
    pub tokens: Vec<u32>,
}

/// Writes one frame and its newline.
fn send(stream: &mut TcpStream, frame: &Frame) -> std::io::Result<()> {
    let mut line = serde_json::to_vec(frame)?;
    line.push(b'\n');
    stream.write_all(&line)
}

/// Reads one frame; `None` at the end of the stream.
fn receive(reader: &mut BufReader<TcpStream>) -> std::io::Result<Option<Frame>> {
    let mut line = String::new();
    if reader.read_line(&mut line)? == 0 {
        return Ok(None);
    }
    serde_json::from_str(&line)
        .map(Some)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

/// Where a served group stands.
#[derive(Clone, Debug, PartialEq)]
enum Phase {
    /// Not every worker has connected yet.
    Waiting,
    /// Every worker is here; the ring is forming or the slices loading.
    Forming,
    Serving,
    /// A worker was lost: why. Starting the workers again forms a new group.
    Broken(String),
}

struct State {
    phase: Phase,
    /// Each worker's control connection (index: rank - 1).
    workers: Vec<Option<TcpStream>>,
    ready: Vec<bool>,
    /// Bumped on every break: a step announced under an older generation
    /// must not run.
    generation: u64,
    /// Whether the group was formed before (the next forming replaces it).
    formed_once: bool,
}

/// Rank 0's side: the control connections to the workers and the state of
/// the group (one per process, [`leader`]).
pub struct Leader {
    world: usize,
    /// Every rank's ring addresses (from the host file): the sockets
    /// [`super::sever`] cuts when a silent worker holds up a step.
    ring: Vec<SocketAddr>,
    state: Mutex<State>,
    changed: Condvar,
    /// Held while a step runs (from its announcement to the end of its
    /// evaluation) and while the group forms: they never overlap.
    step: Mutex<()>,
    next_cache: AtomicU64,
    dropped: Mutex<Vec<u64>>,
}

static LEADER: OnceLock<Leader> = OnceLock::new();

/// This process's leader, when it is rank 0 of a served group.
pub fn leader() -> Option<&'static Leader> {
    LEADER.get()
}

/// Why this process's served group cannot take requests now; `None` when it
/// can, or when this process serves no group.
pub fn not_serving() -> Option<String> {
    leader().and_then(|leader| leader.not_serving())
}

/// A sequence's cache on every rank: the workers keep theirs under `id`
/// until rank 0's copy is dropped.
#[derive(Debug)]
pub struct CacheTicket {
    pub id: u64,
}

impl Drop for CacheTicket {
    fn drop(&mut self) {
        if let Some(leader) = leader() {
            leader.lock(&leader.dropped).push(self.id);
        }
    }
}

/// Holds the group for one step (see [`Leader::begin_step`]).
pub struct StepGuard {
    _step: MutexGuard<'static, ()>,
}

impl Leader {
    /// Listens for `world - 1` workers on `control` and becomes this
    /// process's leader. Call once, before loading the model.
    pub fn start(control: SocketAddr, world: usize, ring: Vec<SocketAddr>) -> std::io::Result<()> {
        if world < 2 {
            return Err(std::io::Error::other(format!(
                "a served group needs at least 2 ranks; the host file lists {world}"
            )));
        }
        let listener = TcpListener::bind(control)?;
        let this = Leader {
            world,
            ring,
            state: Mutex::new(State {
                phase: Phase::Waiting,
                workers: (1..world).map(|_| None).collect(),
                ready: vec![false; world - 1],
                generation: 0,
                formed_once: false,
            }),
            changed: Condvar::new(),
            step: Mutex::new(()),
            next_cache: AtomicU64::new(1),
            dropped: Mutex::new(Vec::new()),
        };
        if LEADER.set(this).is_err() {
            return Err(std::io::Error::other("this process already leads a group"));
        }
        tracing::info!(%control, world, "waiting for the workers of the process group");
        std::thread::Builder::new()
            .name("group-control".into())
            .spawn(move || {
                for stream in listener.incoming() {
                    match stream {
                        Ok(stream) => {
                            if let Some(this) = leader() {
                                this.welcome(stream);
                            }
                        }
                        Err(error) => tracing::warn!(%error, "control connection failed"),
                    }
                }
            })?;
        Ok(())
    }

    fn lock<'a, T>(&self, m: &'a Mutex<T>) -> MutexGuard<'a, T> {
        m.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A new worker's connection: its `Hello`, then a reader of its frames;
    /// once every rank is here, the group forms (on its own thread).
    fn welcome(&'static self, stream: TcpStream) {
        let peer = stream.peer_addr().ok();
        let _ = stream.set_nodelay(true);
        let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
        let Ok(read_half) = stream.try_clone() else {
            return;
        };
        let mut reader = BufReader::new(read_half);
        let mut stream = stream;
        let rank = match receive(&mut reader) {
            Ok(Some(Frame::Hello { rank, world }))
                if world == self.world && (1..world).contains(&rank) =>
            {
                rank
            }
            Ok(Some(Frame::Hello { rank, world })) => {
                let message = format!(
                    "rank {rank} of {world} does not fit this group of {} (ranks 1 to {})",
                    self.world,
                    self.world - 1
                );
                tracing::warn!(?peer, %message, "worker refused");
                let _ = send(&mut stream, &Frame::Failed { message });
                return;
            }
            other => {
                tracing::warn!(?peer, ?other, "a control connection did not say hello");
                return;
            }
        };
        let _ = reader.get_ref().set_read_timeout(Some(SILENCE));
        let (everyone_here, generation) = {
            let mut state = self.lock(&self.state);
            if state.workers[rank - 1].is_some() {
                let message = format!("rank {rank} is already connected");
                tracing::warn!(?peer, %message, "worker refused");
                let _ = send(&mut stream, &Frame::Failed { message });
                return;
            }
            state.workers[rank - 1] = Some(stream);
            state.ready[rank - 1] = false;
            tracing::info!(rank, ?peer, "worker connected");
            (state.workers.iter().all(Option::is_some), state.generation)
        };
        std::thread::Builder::new()
            .name(format!("group-rank-{rank}"))
            .spawn(move || self.listen(rank, generation, reader))
            .expect("spawn a control reader");
        if everyone_here {
            std::thread::Builder::new()
                .name("group-form".into())
                .spawn(move || self.form())
                .expect("spawn the group former");
        }
    }

    /// Reads a worker's frames until its connection ends, which frees its
    /// place and breaks the group (of `generation`, the one it joined: a
    /// group broken since has already let it go).
    fn listen(&self, rank: usize, generation: u64, mut reader: BufReader<TcpStream>) {
        let why = loop {
            match receive(&mut reader) {
                Ok(Some(Frame::Ready)) => {
                    let mut state = self.lock(&self.state);
                    state.ready[rank - 1] = true;
                    if state.phase == Phase::Forming && state.ready.iter().all(|r| *r) {
                        state.phase = Phase::Serving;
                        tracing::info!(world = self.world, "process group serving");
                        self.changed.notify_all();
                    }
                }
                Ok(Some(Frame::Heartbeat)) => {}
                Ok(Some(Frame::Failed { message })) => {
                    break format!("rank {rank} failed: {message}");
                }
                Ok(Some(other)) => break format!("rank {rank} sent {other:?} out of turn"),
                Ok(None) => break format!("rank {rank} left (its control connection closed)"),
                Err(error)
                    if matches!(
                        error.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    break format!(
                        "rank {rank} has been silent for {} s (stopped, or its host cut off)",
                        SILENCE.as_secs()
                    );
                }
                Err(error) => break format!("rank {rank}'s control connection failed: {error}"),
            }
        };
        {
            let mut state = self.lock(&self.state);
            if state.generation != generation {
                return;
            }
            // A worker lost while the group was already broken must not
            // keep its place, or its restart would be refused.
            state.workers[rank - 1] = None;
            state.ready[rank - 1] = false;
        }
        self.break_group(why);
    }

    /// Forms the ring with every worker (anew after a break, once no step
    /// runs).
    fn form(&self) {
        let _step = self.lock(&self.step);
        let again = {
            let mut state = self.lock(&self.state);
            state.phase = Phase::Forming;
            for (index, worker) in state.workers.iter_mut().enumerate() {
                if let Some(stream) = worker
                    && let Err(error) = send(stream, &Frame::FormRing)
                {
                    tracing::warn!(rank = index + 1, %error, "cannot reach a worker");
                }
            }
            state.formed_once
        };
        tracing::info!(again, "forming the process group");
        let formed = if again {
            super::rejoin(BACKEND)
        } else {
            super::join(BACKEND)
        };
        let mut state = self.lock(&self.state);
        match formed {
            Ok(_) => {
                state.formed_once = true;
                if state.phase == Phase::Forming && state.ready.iter().all(|r| *r) {
                    state.phase = Phase::Serving;
                }
                self.changed.notify_all();
            }
            Err(error) => {
                drop(state);
                self.break_group(format!("forming the process group failed: {error}"));
            }
        }
    }

    /// Marks the group lost, closes every worker's connection (so that all
    /// of them exit and can be started again) and forgets their caches.
    fn break_group(&self, why: String) {
        let mut state = self.lock(&self.state);
        if let Phase::Broken(_) = state.phase {
            return;
        }
        tracing::error!(reason = %why, "process group lost; start the workers again to resume");
        state.phase = Phase::Broken(why);
        state.generation += 1;
        for worker in state.workers.iter_mut() {
            if let Some(stream) = worker.take() {
                let _ = stream.shutdown(std::net::Shutdown::Both);
            }
        }
        state.ready.iter_mut().for_each(|r| *r = false);
        self.lock(&self.dropped).clear();
        self.changed.notify_all();
        drop(state);
        // A step (or the group's forming) under way may be waiting on the
        // lost worker forever: cut this rank's ring sockets so that it fails.
        if self.step.try_lock().is_err() {
            let cut = super::sever::sever(&self.ring, &self.ring);
            tracing::warn!(
                sockets = cut,
                "cut this rank's ring sockets under the step in flight"
            );
        }
    }

    fn not_serving(&self) -> Option<String> {
        let state = self.lock(&self.state);
        let connected = state.workers.iter().filter(|w| w.is_some()).count();
        match &state.phase {
            Phase::Serving => None,
            Phase::Waiting => Some(format!(
                "waiting for the workers of the process group ({connected} of {} connected)",
                self.world - 1
            )),
            Phase::Forming => Some("the process group is forming".into()),
            Phase::Broken(why) => Some(format!(
                "the process group lost a worker ({why}); start the workers again ({connected} of {} connected)",
                self.world - 1
            )),
        }
    }

    /// Blocks until the group has formed once (the model is sharded over
    /// it); `timeout` bounds the wait.
    pub fn wait_formed(&self, timeout: Duration) -> Result<(), String> {
        let deadline = Instant::now() + timeout;
        let mut state = self.lock(&self.state);
        while !state.formed_once {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(format!(
                    "no process group after {} s: {}",
                    timeout.as_secs(),
                    match &state.phase {
                        Phase::Broken(why) => why.clone(),
                        _ => "not every worker connected".into(),
                    }
                ));
            }
            state = self
                .changed
                .wait_timeout(state, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        Ok(())
    }

    /// A new cache's ticket.
    pub fn ticket(&self) -> Arc<CacheTicket> {
        Arc::new(CacheTicket {
            id: self.next_cache.fetch_add(1, Ordering::Relaxed),
        })
    }

    /// Announces a forward pass of `tokens` into `caches` to every worker
    /// and holds the group until the returned guard drops (after the pass
    /// is evaluated). Fails at once while the group is not serving.
    pub fn begin_step(
        &'static self,
        tokens: &[&[u32]],
        caches: &[&mut KvCache],
    ) -> Result<StepGuard, String> {
        let generation = {
            let state = self.lock(&self.state);
            if state.phase != Phase::Serving {
                drop(state);
                return Err(self.not_serving().unwrap_or_default());
            }
            state.generation
        };
        let step = self.lock(&self.step);
        let mut rows = Vec::with_capacity(tokens.len());
        for (tokens, cache) in tokens.iter().zip(caches) {
            let ticket = cache.ticket.as_ref().ok_or_else(|| {
                "a cache made outside the process group cannot run on it".to_owned()
            })?;
            rows.push(Row {
                cache: ticket.id,
                offset: cache.offset,
                tokens: tokens.to_vec(),
            });
        }
        let mut state = self.lock(&self.state);
        if state.phase != Phase::Serving || state.generation != generation {
            drop(state);
            return Err(self
                .not_serving()
                .unwrap_or_else(|| "the process group changed".into()));
        }
        let dropped = std::mem::take(&mut *self.lock(&self.dropped));
        let frame = Frame::Forward { rows, dropped };
        let mut failed = None;
        for (index, worker) in state.workers.iter_mut().enumerate() {
            let Some(stream) = worker else {
                failed = Some(format!("rank {} is not connected", index + 1));
                break;
            };
            if let Err(error) = send(stream, &frame) {
                failed = Some(format!("cannot reach rank {}: {error}", index + 1));
                break;
            }
        }
        drop(state);
        if let Some(why) = failed {
            self.break_group(why.clone());
            return Err(why);
        }
        Ok(StepGuard { _step: step })
    }

    /// Breaks the group after a step failed on this rank (a lost peer).
    pub fn step_failed(&self, why: &str) {
        self.break_group(format!("a step failed: {why}"));
    }
}

/// What a client is told of a step that failed on rank 0 (in MLX, most
/// often a lost peer): MLX's own words, without the source locations
/// mlx-c appends.
pub fn step_error(error: &mlx_rs::error::Exception) -> String {
    let text = error.what();
    let what = text.split(" at /").next().unwrap_or(text);
    format!("the model's process group failed mid-step ({what}); it must be formed again")
}

/// What `mlxgate worker` is told.
pub struct WorkerOptions {
    pub control: SocketAddr,
    pub rank: usize,
    pub world: usize,
}

/// A worker's life: connect to rank 0, form the ring when told, load this
/// rank's slice, then run every forward pass rank 0 announces until it
/// closes the connection. `load` loads the model on this thread once the
/// group is formed (sharded over it). Returns why it stopped.
pub fn run_worker(
    options: &WorkerOptions,
    load: impl FnOnce() -> Result<Transformer, String>,
) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(120);
    let stream = loop {
        match TcpStream::connect(options.control) {
            Ok(stream) => break stream,
            Err(error) if Instant::now() < deadline => {
                tracing::debug!(%error, "rank 0 not reachable yet");
                std::thread::sleep(Duration::from_millis(250));
            }
            Err(error) => {
                return Err(format!(
                    "cannot reach rank 0's control address {} for 120 s: {error} (is `mlxgate serve --hostfile ... --rank 0` running?)",
                    options.control
                ));
            }
        }
    };
    let _ = stream.set_nodelay(true);
    let writer = Arc::new(Mutex::new(stream.try_clone().map_err(|e| e.to_string())?));
    let say = |frame: &Frame| {
        let mut stream = writer.lock().unwrap_or_else(|e| e.into_inner());
        send(&mut stream, frame)
    };
    let mut reader = BufReader::new(stream);
    say(&Frame::Hello {
        rank: options.rank,
        world: options.world,
    })
    .map_err(|e| format!("cannot greet rank 0: {e}"))?;
    let beating = Arc::clone(&writer);
    std::thread::Builder::new()
        .name("group-heartbeat".into())
        .spawn(move || {
            loop {
                std::thread::sleep(HEARTBEAT);
                let mut stream = beating.lock().unwrap_or_else(|e| e.into_inner());
                if send(&mut stream, &Frame::Heartbeat).is_err() {
                    return;
                }
            }
        })
        .map_err(|e| e.to_string())?;
    tracing::info!(rank = options.rank, control = %options.control, "connected; waiting for every rank");
    match receive(&mut reader) {
        Ok(Some(Frame::FormRing)) => {}
        Ok(Some(Frame::Failed { message })) => return Err(format!("rank 0 refused: {message}")),
        Ok(other) => {
            return Err(format!(
                "rank 0 sent {other:?} instead of forming the group"
            ));
        }
        Err(error) => return Err(format!("control connection failed: {error}")),
    }
    super::join(BACKEND).map_err(|e| format!("cannot form the process group: {e}"))?;
    let model = load()?;
    say(&Frame::Ready).map_err(|e| e.to_string())?;
    tracing::info!(rank = options.rank, "worker ready");
    let mut caches: HashMap<u64, KvCache> = HashMap::new();
    loop {
        let frame = match receive(&mut reader) {
            Ok(Some(frame)) => frame,
            Ok(None) => return Err("rank 0 closed the control connection".into()),
            Err(error) => return Err(format!("control connection failed: {error}")),
        };
        let outcome = match frame {
            Frame::Forward { rows, dropped } => {
                for id in dropped {
                    caches.remove(&id);
                }
                forward(&model, &mut caches, &rows)
            }
            Frame::Failed { message } => return Err(format!("rank 0: {message}")),
            other => Err(format!("unexpected {other:?}")),
        };
        if let Err(message) = outcome {
            let _ = say(&Frame::Failed {
                message: message.clone(),
            });
            return Err(message);
        }
    }
}

/// One announced forward pass on this rank's slice, evaluated.
fn forward(
    model: &Transformer,
    caches: &mut HashMap<u64, KvCache>,
    rows: &[Row],
) -> Result<(), String> {
    let mut batch = Vec::with_capacity(rows.len());
    for row in rows {
        let cache = caches
            .remove(&row.cache)
            .unwrap_or_else(|| model.new_cache());
        if cache.offset != row.offset {
            return Err(format!(
                "cache {} holds {} positions, rank 0's {}: the ranks went out of step",
                row.cache, cache.offset, row.offset
            ));
        }
        batch.push(cache);
    }
    let tokens: Vec<&[u32]> = rows.iter().map(|row| row.tokens.as_slice()).collect();
    let mut refs: Vec<&mut KvCache> = batch.iter_mut().collect();
    let outcome = model
        .forward(&tokens, &mut refs)
        .map(drop)
        .map_err(|e| e.to_string());
    for (row, cache) in rows.iter().zip(batch) {
        caches.insert(row.cache, cache);
    }
    outcome
}

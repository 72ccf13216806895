//! Counters kept in Redis (or Valkey), shared by every gateway that uses
//! the same server: two Lua scripts, one to check and take a request from
//! every counter of a plan, one to charge tokens, each atomic and on
//! Redis's clock (`TIME`), so replicas with skewed clocks still agree.
//! The scripts are ports of [`gcra`](super::gcra): keep them in step.
//!
//! A counter is a hash (`rt` request TAT, `tt` token TAT, `day`, `used`)
//! that expires two days after its last write. Times travel as `%.17g`
//! strings: Redis turns a Lua number it returns into an integer.
//!
//! When Redis cannot be reached (or answers later than `redis_timeout_ms`)
//! a request is let through or refused as `on_redis_error` says; the change
//! of state is logged once each way, and the connection manager reconnects
//! in the background.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock, OnceLock};
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Script, ScriptInvocation};
use tracing::{debug, info, warn};

use super::gcra::{self, State};
use super::{LimitError, LimitsConfig, OnRedisError, Plan, Quota, decide};

/// Checks every counter (KEYS) for one more request and takes it from all
/// of them or none. ARGV: the time scale's origin, 1 to take (0 only to
/// read), then per counter its requests per minute, tokens per minute and
/// daily tokens (0: none). Returns now, 1 or 0 (taken or not), then each
/// counter's state as read.
const ADMIT: &str = r"
local t = redis.call('TIME')
local now = (tonumber(t[1]) - tonumber(ARGV[1])) * 1e6 + tonumber(t[2])
local P, DAY = 60e6, 86400e6
local today = math.floor(now / DAY)
local out = {string.format('%.17g', now), 1}
local pass = true
local new_rt = {}
for i, key in ipairs(KEYS) do
  local rpm, tpm, daily = tonumber(ARGV[3*i]), tonumber(ARGV[3*i+1]), tonumber(ARGV[3*i+2])
  local h = redis.call('HMGET', key, 'rt', 'tt', 'day', 'used')
  local rt, tt = tonumber(h[1]) or 0, tonumber(h[2]) or 0
  local day, used = tonumber(h[3]) or 0, tonumber(h[4]) or 0
  for _, v in ipairs({rt, tt, day, used}) do out[#out+1] = string.format('%.17g', v) end
  if daily > 0 and day == today and used >= daily then pass = false end
  if tpm > 0 then
    local iv = P / tpm
    if P - (math.max(tt, now) - now) < iv - math.min(iv / 2, 0.5) then pass = false end
  end
  new_rt[i] = rt
  if rpm > 0 then
    local iv = P / rpm
    new_rt[i] = math.max(rt, now) + iv
    if new_rt[i] - now > P + math.min(iv / 2, 0.5) then pass = false end
  end
end
if pass and ARGV[2] == '1' then
  for i, key in ipairs(KEYS) do
    redis.call('HSET', key, 'rt', string.format('%.17g', new_rt[i]))
    redis.call('PEXPIRE', key, 172800000)
  end
else
  out[2] = 0
end
return out
";

/// Charges ARGV[2] tokens to every counter (KEYS). ARGV: the time scale's
/// origin, the tokens, then per counter its tokens per minute and daily
/// tokens (0: none).
const CHARGE: &str = r"
local t = redis.call('TIME')
local now = (tonumber(t[1]) - tonumber(ARGV[1])) * 1e6 + tonumber(t[2])
local n = tonumber(ARGV[2])
local today = math.floor(now / 86400e6)
for i, key in ipairs(KEYS) do
  local tpm, daily = tonumber(ARGV[2*i+1]), tonumber(ARGV[2*i+2])
  if tpm > 0 then
    local tt = tonumber(redis.call('HGET', key, 'tt')) or 0
    redis.call('HSET', key, 'tt', string.format('%.17g', math.max(tt, now) + n * (60e6 / tpm)))
  end
  if daily > 0 then
    local h = redis.call('HMGET', key, 'day', 'used')
    local used = 0
    if tonumber(h[1]) == today then used = tonumber(h[2]) or 0 end
    redis.call('HSET', key, 'day', today, 'used', used + n)
  end
  redis.call('PEXPIRE', key, 172800000)
end
return 1
";

/// The scripts, made once (each holds its SHA-1 for `EVALSHA`).
static ADMIT_SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(ADMIT));
static CHARGE_SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(CHARGE));

pub struct RedisStore {
    client: Option<redis::Client>,
    /// Made on first use, inside the runtime of [`Self::runtime`].
    connection: OnceLock<Option<ConnectionManager>>,
    /// The runtime the store was made in (the server's), whose tasks keep
    /// the connection and send charges.
    runtime: Option<tokio::runtime::Handle>,
    prefix: String,
    timeout: Duration,
    on_error: OnRedisError,
    /// Whether the last call succeeded (state changes are logged).
    reachable: Arc<AtomicBool>,
}

impl RedisStore {
    pub fn new(config: &LimitsConfig) -> RedisStore {
        let client = config
            .redis_url
            .as_deref()
            .and_then(|url| redis::Client::open(url).ok());
        RedisStore {
            client,
            connection: OnceLock::new(),
            runtime: tokio::runtime::Handle::try_current().ok(),
            prefix: config.redis_key_prefix.clone(),
            timeout: config.redis_timeout(),
            on_error: config.on_redis_error,
            reachable: Arc::new(AtomicBool::new(true)),
        }
    }

    fn connection(&self) -> Option<ConnectionManager> {
        self.connection
            .get_or_init(|| {
                let client = self.client.clone()?;
                let _entered = self.runtime.as_ref().map(|r| r.enter());
                // Short waits: a request never stalls on a Redis that is
                // gone; reconnecting goes on in the background.
                let config = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(self.timeout))
                    .set_response_timeout(Some(self.timeout))
                    .set_number_of_retries(1)
                    .set_max_delay(Duration::from_millis(500));
                match ConnectionManager::new_lazy_with_config(client, config) {
                    Ok(c) => Some(c),
                    Err(e) => {
                        warn!(error = %e, "cannot set up the Redis connection for [limits]");
                        None
                    }
                }
            })
            .clone()
    }

    fn key(&self, id: &str) -> String {
        format!("{}{id}", self.prefix)
    }

    /// Runs the admit script on `plan`'s counters, taking the request when
    /// `take`: now, whether it passed, and the counters' states as read.
    async fn read(&self, plan: &Plan, take: bool) -> Result<(f64, bool, Vec<State>), String> {
        let mut call = ADMIT_SCRIPT.prepare_invoke();
        call.arg(gcra::EPOCH_SECS).arg(u8::from(take));
        for c in &plan.counters {
            call.key(self.key(&c.id));
            call.arg(c.rates.requests_per_minute.unwrap_or(0));
            call.arg(c.rates.tokens_per_minute.unwrap_or(0));
            call.arg(c.rates.daily_tokens.unwrap_or(0));
        }
        let answer: Vec<String> = self.invoke(&call).await?;
        let numbers: Vec<f64> = answer.iter().map(|s| s.parse().unwrap_or(0.0)).collect();
        let now = numbers.first().copied().unwrap_or(0.0);
        let passed = numbers.get(1) == Some(&1.0);
        let states = numbers
            .get(2..)
            .unwrap_or_default()
            .chunks_exact(4)
            .map(|s| State {
                request_tat: s[0],
                token_tat: s[1],
                day: s[2] as i64,
                day_tokens: s[3] as u64,
            })
            .collect();
        Ok((now, passed, states))
    }

    pub async fn peek(&self, plan: &Plan) -> Quota {
        match self.read(plan, false).await {
            Ok((now, _, states)) => Quota::of(plan, &states, now),
            Err(_) => Quota::default(),
        }
    }

    pub async fn admit(&self, plan: &Plan) -> Result<Quota, LimitError> {
        let (now, taken, states) = match self.read(plan, true).await {
            Ok(read) => read,
            Err(e) => {
                return match self.on_error {
                    OnRedisError::Allow => {
                        debug!(error = %e, "rate limits not checked: Redis unreachable (on_redis_error = allow)");
                        Ok(Quota::default())
                    }
                    OnRedisError::Refuse => Err(LimitError::Unavailable),
                };
            }
        };
        match decide(plan, &states, now) {
            Ok(tats) if taken => {
                let after: Vec<State> = states
                    .iter()
                    .zip(tats)
                    .map(|(s, request_tat)| State { request_tat, ..*s })
                    .collect();
                Ok(Quota::of(plan, &after, now))
            }
            Err(refused) if !taken => Err(refused),
            // The script and `gcra` disagree (they must not): the script
            // decided; the headers show the state as read.
            _ => {
                warn!(
                    taken,
                    "the Redis limit script and gcra.rs disagree; keep them in step"
                );
                if taken {
                    Ok(Quota::of(plan, &states, now))
                } else {
                    Err(LimitError::Unavailable)
                }
            }
        }
    }

    pub fn charge(&self, plan: &Arc<Plan>, tokens: u64) {
        let mut call = CHARGE_SCRIPT.prepare_invoke();
        call.arg(gcra::EPOCH_SECS).arg(tokens);
        let mut counts = false;
        for c in &plan.counters {
            if c.rates.tokens_per_minute.is_none() && c.rates.daily_tokens.is_none() {
                continue;
            }
            counts = true;
            call.key(self.key(&c.id));
            call.arg(c.rates.tokens_per_minute.unwrap_or(0));
            call.arg(c.rates.daily_tokens.unwrap_or(0));
        }
        if !counts {
            return;
        }
        let Some(mut connection) = self.connection() else {
            return;
        };
        let (timeout, reachable) = (self.timeout, Arc::clone(&self.reachable));
        let task = async move {
            let sent =
                tokio::time::timeout(timeout, call.invoke_async::<i64>(&mut connection)).await;
            note_reachable(&reachable, flatten(sent).map(drop));
        };
        match (tokio::runtime::Handle::try_current(), &self.runtime) {
            (Ok(here), _) => drop(here.spawn(task)),
            (Err(_), Some(runtime)) => drop(runtime.spawn(task)),
            (Err(_), None) => debug!("tokens not charged: no runtime to reach Redis from"),
        }
    }

    async fn invoke(&self, call: &ScriptInvocation<'_>) -> Result<Vec<String>, String> {
        let result = match self.connection() {
            Some(mut c) => {
                flatten(tokio::time::timeout(self.timeout, call.invoke_async(&mut c)).await)
            }
            None => Err("no Redis connection (see the log at start)".into()),
        };
        note_reachable(
            &self.reachable,
            result.as_ref().map(|_| ()).map_err(Clone::clone),
        );
        result
    }
}

fn flatten<T>(r: Result<redis::RedisResult<T>, tokio::time::error::Elapsed>) -> Result<T, String> {
    match r {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err("timed out".into()),
    }
}

/// Logs Redis going away and coming back, once each.
fn note_reachable(reachable: &AtomicBool, result: Result<(), String>) {
    match result {
        Ok(()) => {
            if !reachable.swap(true, Ordering::Relaxed) {
                info!("Redis reachable again: rate limits are shared and enforced");
            }
        }
        Err(e) => {
            if reachable.swap(false, Ordering::Relaxed) {
                warn!(error = %e, "Redis unreachable: rate limits follow [limits] on_redis_error until it returns");
            }
        }
    }
}

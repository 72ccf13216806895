//! Generated ids -> text that is safe to show: incremental detokenization
//! that never splits a UTF-8 character, and stop strings that are never
//! emitted, not even in part, across stream chunks.

/// Turns one generated id at a time into text deltas.
pub struct Detokenizer {
    ids: Vec<u32>,
    /// Ids before `prefix` are settled; decoding starts there for context.
    prefix: usize,
    /// Ids before `read` have been emitted.
    read: usize,
}

impl Detokenizer {
    pub fn new() -> Detokenizer {
        Detokenizer {
            ids: Vec::new(),
            prefix: 0,
            read: 0,
        }
    }

    /// Adds `id`; returns newly complete text (empty while a character is unfinished).
    pub fn push(&mut self, id: u32, decode: impl Fn(&[u32]) -> String) -> String {
        self.ids.push(id);
        let before = decode(&self.ids[self.prefix..self.read]);
        let after = decode(&self.ids[self.prefix..]);
        if after.len() > before.len() && !after.ends_with('\u{FFFD}') && after.starts_with(&before)
        {
            let delta = after[before.len()..].to_owned();
            self.prefix = self.read;
            self.read = self.ids.len();
            delta
        } else {
            String::new()
        }
    }
}

impl Default for Detokenizer {
    fn default() -> Self {
        Detokenizer::new()
    }
}

/// Holds back text that might be the start of a stop string.
pub struct StopFilter {
    stops: Vec<String>,
    pending: String,
}

/// What to emit after feeding text.
#[derive(Debug, PartialEq, Eq)]
pub enum Filtered {
    /// Emit this (possibly empty) text and go on.
    Continue(String),
    /// Stop string `.1` (its index) was found: emit this text, then finish.
    Stop(String, usize),
}

impl StopFilter {
    pub fn new(stops: Vec<String>) -> StopFilter {
        StopFilter {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            pending: String::new(),
        }
    }

    pub fn feed(&mut self, text: &str) -> Filtered {
        if self.stops.is_empty() {
            return Filtered::Continue(text.to_owned());
        }
        self.pending.push_str(text);
        let earliest = self
            .stops
            .iter()
            .enumerate()
            .filter_map(|(i, stop)| self.pending.find(stop.as_str()).map(|at| (at, i)))
            .min();
        if let Some((at, which)) = earliest {
            let out = self.pending[..at].to_owned();
            self.pending.clear();
            return Filtered::Stop(out, which);
        }
        // Keep the longest tail that is a proper prefix of some stop string.
        let held = self
            .stops
            .iter()
            .map(|stop| held_prefix(&self.pending, stop))
            .max()
            .unwrap_or(0);
        let cut = self.pending.len() - held;
        let out = self.pending[..cut].to_owned();
        self.pending.drain(..cut);
        Filtered::Continue(out)
    }

    /// Text held back when generation ends for another reason.
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

/// Length of the longest tail of `text` that is a proper prefix of `stop`
/// (longest first, so the usual case stops at the first comparison).
fn held_prefix(text: &str, stop: &str) -> usize {
    let longest = (stop.len() - 1).min(text.len());
    (1..=longest)
        .rev()
        .find(|&n| stop.is_char_boundary(n) && text.ends_with(&stop[..n]))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stop_string_split_across_chunks_is_never_emitted() {
        let mut filter = StopFilter::new(vec!["</end>".into()]);
        let mut shown = String::new();
        for chunk in ["Hello </", "en", "d> world"] {
            match filter.feed(chunk) {
                Filtered::Continue(text) => shown.push_str(&text),
                Filtered::Stop(text, which) => {
                    assert_eq!(which, 0);
                    shown.push_str(&text);
                    break;
                }
            }
        }
        assert_eq!(shown, "Hello ");
    }

    #[test]
    fn a_false_start_is_released_and_flush_returns_the_rest() {
        let mut filter = StopFilter::new(vec!["STOP".into()]);
        assert_eq!(filter.feed("ab ST"), Filtered::Continue("ab ".into()));
        assert_eq!(filter.feed("ay"), Filtered::Continue("STay".into()));
        assert_eq!(filter.feed("S"), Filtered::Continue(String::new()));
        assert_eq!(filter.flush(), "S");
    }

    #[test]
    fn detokenizer_waits_for_whole_characters() {
        // A toy decoder: ids are bytes; invalid UTF-8 shows as U+FFFD.
        let decode = |ids: &[u32]| {
            String::from_utf8_lossy(&ids.iter().map(|&i| i as u8).collect::<Vec<_>>()).into_owned()
        };
        let mut detok = Detokenizer::new();
        let bytes = "é!".as_bytes();
        assert_eq!(detok.push(bytes[0] as u32, decode), "");
        assert_eq!(detok.push(bytes[1] as u32, decode), "é");
        assert_eq!(detok.push(bytes[2] as u32, decode), "!");
    }
}

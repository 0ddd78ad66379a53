//! Stop strings over a stream of text pieces.
//!
//! Text is released only when it can no longer be the start of a stop string: a suffix that is
//! a proper prefix of some stop string is held back until the next piece decides it. When a stop
//! string appears, the text before it is released and the rest (the stop string and anything
//! after it) is dropped. So a client never sees a stop string, not even part of one.

/// Incremental stop-string matcher. Holds only the undecided tail of the text.
#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    /// Text not released yet (a possible start of a stop string).
    held: String,
    stopped: bool,
}

impl StopMatcher {
    /// A matcher for `stops` (empty strings are ignored).
    pub fn new(stops: Vec<String>) -> Self {
        StopMatcher { stops: stops.into_iter().filter(|s| !s.is_empty()).collect(), held: String::new(), stopped: false }
    }

    /// True once a stop string was seen.
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// Adds `piece`; appends the text that became final to `out` and returns true when a stop
    /// string was completed (nothing more should be generated).
    pub fn push(&mut self, piece: &str, out: &mut String) -> bool {
        if self.stopped {
            return true;
        }
        if self.stops.is_empty() {
            out.push_str(piece);
            return false;
        }
        self.held.push_str(piece);
        // A complete stop string: release what precedes the earliest one.
        let hit = self.stops.iter().filter_map(|s| self.held.find(s.as_str())).min();
        if let Some(p) = hit {
            out.push_str(&self.held[..p]);
            self.held.clear();
            self.stopped = true;
            return true;
        }
        // Hold back the longest suffix that is a proper prefix of a stop string.
        let mut keep = 0usize;
        for s in &self.stops {
            for (k, _) in s.char_indices().skip(1) {
                if k > keep && self.held.ends_with(&s[..k]) {
                    keep = k;
                }
            }
        }
        let cut = self.held.len() - keep;
        out.push_str(&self.held[..cut]);
        self.held.drain(..cut);
        false
    }

    /// The stream ended for another reason: the held text is final after all.
    pub fn finish(&mut self, out: &mut String) {
        if !self.stopped {
            out.push_str(&self.held);
        }
        self.held.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (Vec<String>, bool) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut outs = Vec::new();
        let mut stopped = false;
        for p in pieces {
            let mut o = String::new();
            stopped = m.push(p, &mut o);
            outs.push(o);
            if stopped {
                break;
            }
        }
        if !stopped {
            let mut o = String::new();
            m.finish(&mut o);
            outs.push(o);
        }
        (outs, stopped)
    }

    #[test]
    fn no_stops_passes_through() {
        assert_eq!(run(&[], &["a", "b"]).0, vec!["a", "b", ""]);
    }

    #[test]
    fn stop_inside_one_piece() {
        let (o, s) = run(&["END"], &["abcENDxyz"]);
        assert!(s);
        assert_eq!(o, vec!["abc"]);
    }

    #[test]
    fn stop_across_pieces_never_leaks() {
        let (o, s) = run(&["\n\n"], &["Hello", "\n", "\n", "more"]);
        assert!(s);
        assert_eq!(o, vec!["Hello", "", ""]);
        let (o, s) = run(&["STOP"], &["xS", "T", "O", "P", "y"]);
        assert!(s);
        assert_eq!(o.concat(), "x");
        assert!(o.iter().all(|p| !p.contains('S')));
    }

    #[test]
    fn false_alarm_is_released() {
        let (o, s) = run(&["STOP"], &["xST", "ay"]);
        assert!(!s);
        assert_eq!(o, vec!["x", "STay", ""]);
        // Held text at the end of the stream is released.
        let (o, _) = run(&["STOP"], &["abST"]);
        assert_eq!(o.concat(), "abST");
    }

    #[test]
    fn earliest_of_several_stops_wins() {
        let (o, s) = run(&["world", "lo"], &["hello world"]);
        assert!(s);
        assert_eq!(o.concat(), "hel");
    }

    #[test]
    fn multibyte_prefixes() {
        let (o, s) = run(&["éé"], &["aé", "é"]);
        assert!(s);
        assert_eq!(o.concat(), "a");
    }
}

//! Wall-clock time as the APIs and files show it: Unix seconds and UTC
//! calendar dates, without a date-time crate.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Time since the Unix epoch (zero for a clock set before it).
fn since_epoch(t: SystemTime) -> Duration {
    t.duration_since(UNIX_EPOCH).unwrap_or_default()
}

/// Unix seconds now (OpenAI's `created`, file headers).
pub fn unix_secs() -> u64 {
    unix_secs_at(SystemTime::now())
}

/// Unix seconds of `t`.
pub fn unix_secs_at(t: SystemTime) -> u64 {
    since_epoch(t).as_secs()
}

/// Unix seconds now, fractional (job events).
pub fn unix_secs_f64() -> f64 {
    since_epoch(SystemTime::now()).as_secs_f64()
}

/// A UTC calendar date.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Date {
    pub year: i64,
    /// 1-12.
    pub month: u32,
    /// 1-31.
    pub day: u32,
}

impl Date {
    /// The proleptic Gregorian date `days` after 1970-01-01 (Howard
    /// Hinnant's civil-from-days).
    pub fn from_days(days: i64) -> Date {
        let z = days + 719_468;
        let era = z.div_euclid(146_097);
        let doe = z.rem_euclid(146_097);
        let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
        let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
        let mp = (5 * doy + 2) / 153;
        let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
        let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
        Date {
            year: yoe + era * 400 + i64::from(month <= 2),
            month,
            day,
        }
    }

    /// `YYYY-MM-DD`.
    pub fn iso(&self) -> String {
        format!("{:04}-{:02}-{:02}", self.year, self.month, self.day)
    }

    /// Reads `YYYY-MM-DD` (month 1-12, day 1-31); `None` otherwise.
    pub fn parse_iso(s: &str) -> Option<Date> {
        let b = s.as_bytes();
        if b.len() != 10 || b[4] != b'-' || b[7] != b'-' {
            return None;
        }
        let num = |r: std::ops::Range<usize>| s.get(r)?.parse::<u32>().ok();
        let (year, month, day) = (num(0..4)?, num(5..7)?, num(8..10)?);
        ((1..=12).contains(&month) && (1..=31).contains(&day)).then_some(Date {
            year: i64::from(year),
            month,
            day,
        })
    }

    /// Today, in UTC.
    pub fn today() -> Date {
        Date::from_days((since_epoch(SystemTime::now()).as_secs() / 86_400) as i64)
    }
}

/// RFC 3339 UTC timestamp of now with milliseconds (`2026-12-05T08:00:00.123Z`).
pub fn rfc3339_now() -> String {
    let d = since_epoch(SystemTime::now());
    let secs = d.as_secs();
    let Date { year, month, day } = Date::from_days((secs / 86_400) as i64);
    let rem = secs % 86_400;
    let (h, m, s) = (rem / 3600, rem % 3600 / 60, rem % 60);
    format!(
        "{year:04}-{month:02}-{day:02}T{h:02}:{m:02}:{s:02}.{:03}Z",
        d.subsec_millis()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn civil_dates_from_days() {
        let d = |year, month, day| Date { year, month, day };
        assert_eq!(Date::from_days(0), d(1970, 1, 1));
        assert_eq!(Date::from_days(-1), d(1969, 12, 31));
        assert_eq!(Date::from_days(11_016), d(2000, 2, 29));
        assert_eq!(Date::from_days(20_792), d(2026, 12, 5));
        assert_eq!(d(2026, 2, 3).iso(), "2026-02-03");
        assert_eq!(Date::parse_iso("2026-02-03"), Some(d(2026, 2, 3)));
        for bad in [
            "2026-13-01",
            "2026-1-01",
            "20260101",
            "2026-02-00",
            "abcd-ef-gh",
        ] {
            assert_eq!(Date::parse_iso(bad), None, "{bad}");
        }
        let t = rfc3339_now();
        assert_eq!((t.len(), &t[10..11], &t[23..]), (24, "T", "Z"), "{t}");
    }
}

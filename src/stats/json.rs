//! [`Stats`] as JSON, written by hand: `serde` stays an optional feature, and the exit report must
//! format without allocating. The shape is what `serde_json` makes of the `serde` feature's
//! `Serialize` (a test checks they agree): field names as in Rust, durations in nanoseconds,
//! errors as their messages.

use std::fmt::{self, Write};
use std::time::Duration;

use super::{CudaErrorCount, GpuStats, HeapStats, NodeStats, Stats, TimeStats};
use crate::Error;
use crate::MemPolicy;

impl Stats {
    /// The snapshot as one line of JSON, e.g. `{"initialized":true,"threshold":2097152,...}`:
    /// field names as in Rust, durations in nanoseconds, errors as their messages.
    /// `NUMA_GPU_ALLOC=stats=json` prints it at exit.
    ///
    /// ```
    /// let stats = numa_gpu_alloc::NumaGpuAlloc::new().stats();
    /// let json = stats.json().to_string();
    /// assert!(json.starts_with(r#"{"initialized":false,"threshold":2097152,"#));
    /// ```
    pub fn json(&self) -> impl fmt::Display + '_ {
        Json(self)
    }
}

/// Displays its value as JSON.
struct Json<'a, T: ?Sized>(&'a T);

impl<T: ToJson + ?Sized> fmt::Display for Json<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.write_json(f)
    }
}

/// A value that writes itself as JSON.
pub(super) trait ToJson {
    fn write_json(&self, out: &mut dyn Write) -> fmt::Result;
}

/// Writes `{"name":value,...}`, one `field` at a time.
pub(super) struct Object<'a> {
    out: &'a mut dyn Write,
    empty: bool,
}

impl<'a> Object<'a> {
    pub(super) fn start(out: &'a mut dyn Write) -> Result<Self, fmt::Error> {
        out.write_char('{')?;
        Ok(Object { out, empty: true })
    }

    pub(super) fn field(
        &mut self,
        name: &str,
        value: &dyn ToJson,
    ) -> Result<&mut Self, fmt::Error> {
        if !self.empty {
            self.out.write_char(',')?;
        }
        self.empty = false;
        name.write_json(self.out)?;
        self.out.write_char(':')?;
        value.write_json(self.out)?;
        Ok(self)
    }

    pub(super) fn end(&mut self) -> fmt::Result {
        self.out.write_char('}')
    }
}

macro_rules! json_number {
    ($($t:ty),*) => {$(
        impl ToJson for $t {
            fn write_json(&self, out: &mut dyn Write) -> fmt::Result {
                write!(out, "{self}")
            }
        }
    )*};
}
json_number!(bool, u32, u64, usize);

impl ToJson for str {
    fn write_json(&self, out: &mut dyn Write) -> fmt::Result {
        out.write_char('"')?;
        Escaped(out).write_str(self)?;
        out.write_char('"')
    }
}

impl ToJson for String {
    fn write_json(&self, out: &mut dyn Write) -> fmt::Result {
        self.as_str().write_json(out)
    }
}

impl<T: ToJson + ?Sized> ToJson for &T {
    fn write_json(&self, out: &mut dyn Write) -> fmt::Result {
        (**self).write_json(out)
    }
}

impl<T: ToJson> ToJson for Option<T> {
    fn write_json(&self, out: &mut dyn Write) -> fmt::Result {
        match self {
            Some(value) => value.write_json(out),
            None => out.write_str("null"),
        }
    }
}

fn write_array<T: ToJson>(items: &[T], out: &mut dyn Write) -> fmt::Result {
    out.write_char('[')?;
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            out.write_char(',')?;
        }
        item.write_json(out)?;
    }
    out.write_char(']')
}

impl<T: ToJson> ToJson for Vec<T> {
    fn write_json(&self, out: &mut dyn Write) -> fmt::Result {
        write_array(self, out)
    }
}

impl<T: ToJson, const N: usize> ToJson for [T; N] {
    fn write_json(&self, out: &mut dyn Write) -> fmt::Result {
        write_array(self, out)
    }
}

/// Nanoseconds, saturating at `u64::MAX` (585 years).
impl ToJson for Duration {
    fn write_json(&self, out: &mut dyn Write) -> fmt::Result {
        write!(
            out,
            "{}",
            u64::try_from(self.as_nanos()).unwrap_or(u64::MAX)
        )
    }
}

/// The variant's name, as a string (as serde writes a unit variant).
impl ToJson for MemPolicy {
    fn write_json(&self, out: &mut dyn Write) -> fmt::Result {
        write!(out, "\"{self:?}\"")
    }
}

/// The message, as a string.
impl ToJson for Error {
    fn write_json(&self, out: &mut dyn Write) -> fmt::Result {
        out.write_char('"')?;
        write!(Escaped(out), "{self}")?;
        out.write_char('"')
    }
}

/// Writes a struct as a JSON object of the fields listed. The pattern lists every field, so adding
/// one to the struct fails to compile here until it is written too. (Paths are spelled out:
/// `snapshot!` expands this in `stats.rs`, for the structs it declares.)
macro_rules! json_object {
    ($($ty:ident { $($field:ident),* $(,)? })*) => {$(
        impl $crate::stats::json::ToJson for $ty {
            fn write_json(&self, out: &mut dyn ::std::fmt::Write) -> ::std::fmt::Result {
                let $ty { $($field),* } = self;
                $crate::stats::json::Object::start(out)?
                    $(.field(stringify!($field), $field)?)*
                    .end()
            }
        }
    )*};
}
pub(super) use json_object;

json_object! {
    TimeStats { total, max }
    CudaErrorCount { code, name, count }
    NodeStats {
        node,
        live_bytes,
        peak_live_bytes,
        cached_bytes,
        pinned_bytes,
        live_blocks,
        cached_blocks,
        pending_blocks,
        pending_bytes,
        chunks,
        mapped_bytes,
        resident_bytes,
        free_bytes,
        free_ranges,
        largest_free,
        registrations,
        purged_bytes,
        decay_released,
    }
    HeapStats {
        node,
        policy,
        pinned,
        huge_pages,
        reserved,
        chunks,
        mapped_bytes,
        resident_bytes,
        pinned_bytes,
        free_bytes,
        free_ranges,
        largest_free,
        chunks_made,
        registrations,
        purged_bytes,
    }
    GpuStats {
        ordinal,
        node,
        live_bytes,
        peak_live_bytes,
        pinned_bytes,
        live_blocks,
    }
}

/// Escapes what it is given for a JSON string, the way `serde_json` does: `"` and `\`, the
/// control characters below U+0020 (short forms where JSON has them, else `\u00XX`).
struct Escaped<'a>(&'a mut dyn Write);

impl Write for Escaped<'_> {
    fn write_str(&mut self, text: &str) -> fmt::Result {
        let mut plain = 0;
        for (i, c) in text.char_indices() {
            let short = match c {
                '"' => "\\\"",
                '\\' => "\\\\",
                '\n' => "\\n",
                '\r' => "\\r",
                '\t' => "\\t",
                '\u{8}' => "\\b",
                '\u{c}' => "\\f",
                c if c < ' ' => "",
                _ => continue,
            };
            self.0.write_str(&text[plain..i])?;
            if short.is_empty() {
                write!(self.0, "\\u{:04x}", u32::from(c))?;
            } else {
                self.0.write_str(short)?;
            }
            plain = i + c.len_utf8();
        }
        self.0.write_str(&text[plain..])
    }
}

/// `Duration` fields as nanoseconds, for the `serde` feature.
#[cfg(feature = "serde")]
pub(crate) fn nanos<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_u64(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// An optional error as its message, for the `serde` feature.
#[cfg(feature = "serde")]
pub(crate) fn message<S: serde::Serializer>(e: &Option<Error>, s: S) -> Result<S::Ok, S::Error> {
    match e {
        Some(e) => s.collect_str(e),
        None => s.serialize_none(),
    }
}

/// Errors as their messages, for the `serde` feature.
#[cfg(feature = "serde")]
pub(crate) fn messages<S: serde::Serializer>(errors: &[Error], s: S) -> Result<S::Ok, S::Error> {
    struct Message<'a>(&'a Error);
    impl serde::Serialize for Message<'_> {
        fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            s.collect_str(self.0)
        }
    }
    s.collect_seq(errors.iter().map(Message))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::Fallbacks;

    /// A snapshot with every kind of field set, strings that need escaping among them.
    fn sample() -> Stats {
        Stats {
            initialized: true,
            threshold: 2 << 20,
            host_node: Some(1),
            home_node: None,
            gpu: Some("0 (0000:81:00.0) \"H200\"\\\n\u{1}é".to_owned()),
            nodes: vec![
                NodeStats {
                    node: 0,
                    ..NodeStats::default()
                },
                NodeStats {
                    node: 1,
                    live_bytes: 3 << 20,
                    peak_live_bytes: 5 << 20,
                    cached_blocks: 2,
                    ..NodeStats::default()
                },
            ],
            large_allocations: u64::MAX,
            populate_time: TimeStats {
                total: Duration::from_millis(1500),
                max: Duration::from_nanos(7),
            },
            fallbacks: Fallbacks {
                unpinned_blocks: 4,
                ..Fallbacks::default()
            },
            pin_failures_by_code: vec![CudaErrorCount {
                code: 712,
                name: "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
                count: 3,
            }],
            numa_unavailable: Some(Error::CudaUnavailable { reason: "x\ty" }),
            config_errors: vec![crate::config::config_error("colour", "bl\"ue", "a key")],
            ..Stats::default()
        }
    }

    #[test]
    fn json_is_valid_and_holds_the_values() {
        let stats = sample();
        let text = stats.json().to_string();
        assert!(!text.contains('\n'), "one line: {text}");
        let v: serde_json::Value = serde_json::from_str(&text).expect(&text);
        assert_eq!(v["threshold"], 2 << 20);
        assert_eq!(v["home_node"], serde_json::Value::Null);
        assert_eq!(v["gpu"], "0 (0000:81:00.0) \"H200\"\\\n\u{1}é");
        assert_eq!(v["nodes"][1]["peak_live_bytes"], 5 << 20);
        assert_eq!(v["large_allocations"], u64::MAX);
        assert_eq!(v["populate_time"]["total"], 1_500_000_000);
        assert_eq!(v["fallbacks"]["unpinned_blocks"], 4);
        assert_eq!(v["pin_failures_by_code"][0]["code"], 712);
        assert_eq!(v["numa_unavailable"], "CUDA unavailable: x\ty");
        assert_eq!(
            v["config_errors"][0],
            "bad setting colour=\"bl\\\"ue\": expected a key"
        );
    }

    #[test]
    fn escapes_like_serde_json() {
        let text = "a\"b\\c\n\r\t\u{8}\u{c}\u{0}\u{1f}\u{7f}é😀";
        let ours = Json(text).to_string();
        assert_eq!(ours, serde_json::to_string(text).unwrap());
    }

    #[cfg(feature = "serde")]
    #[test]
    fn serde_gives_the_same_json() {
        let stats = sample();
        assert_eq!(
            serde_json::to_string(&stats).unwrap(),
            stats.json().to_string()
        );
        let empty = Stats::default();
        assert_eq!(
            serde_json::to_string(&empty).unwrap(),
            empty.json().to_string()
        );
    }
}

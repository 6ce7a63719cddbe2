//! Parsing of `NUMA_GPU_ALLOC` (`key=value,key=value`, see [`Settings`]) and of its values:
//! sizes ([`parse_size`]), thresholds, nodes, GPU selectors, policies, switches.
//!
//! Written by hand, like everything that runs inside the allocator: no panic, and the only
//! allocations are the error values and the list of accepted entries.

use super::{Config, GpuSelector, PinMode, Reserve, StatsAtExit, Target};
use super::{MAX_REGISTER_MAX, MAX_THRESHOLD, MIN_REGISTER_MAX, MIN_THRESHOLD};
use crate::sys::{MemPolicy, MAX_NODES};
use crate::Error;

/// One accepted entry, parsed: what it sets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Setting {
    Threshold(usize),
    /// `node=` or `gpu=`.
    Target(Target),
    Policy(MemPolicy),
    CacheLimit(usize),
    HugePages(bool),
    Verify(bool),
    Pin(PinMode),
    PinDevicemap(bool),
    PinReadOnly(bool),
    PinLimit(usize),
    PopulateThreads(usize),
    PopulateEager(bool),
    BulkMax(usize),
    StatsAtExit(StatsAtExit),
    Reserve(Reserve),
    ReserveBackground(bool),
    RegisterMax(usize),
    DecayMs(u64),
    DecayThread(bool),
}

/// A `NUMA_GPU_ALLOC`-style string, parsed: the accepted entries in order (a later one of the
/// same key applies over an earlier one), and its problems, each once: the rejected entries,
/// each key given more than once, and accepted values that switch something off.
#[derive(Debug, Default)]
pub(crate) struct Settings {
    accepted: Vec<Setting>,
    pub(crate) errors: Vec<Error>,
}

impl Settings {
    pub(crate) fn parse(settings: &str) -> Settings {
        let mut parsed = Settings::default();
        let mut seen: Vec<&str> = Vec::new();
        // Keys given more than once, with their error's place in `errors`.
        let mut repeated: Vec<(&str, usize)> = Vec::new();
        for entry in settings.split(',').map(str::trim).filter(|e| !e.is_empty()) {
            let Some((key, value)) = entry.split_once('=') else {
                parsed.add(config_error(entry, "", "key=value"));
                continue;
            };
            let (key, value) = (key.trim(), value.trim());
            if let Some(&(_, at)) = repeated.iter().find(|(k, _)| *k == key) {
                // One error however often the key is repeated, naming the latest value.
                if let Some(Error::Config { value: latest, .. }) = parsed.errors.get_mut(at) {
                    value.clone_into(latest);
                }
            } else if seen.contains(&key) {
                repeated.push((key, parsed.errors.len()));
                parsed.errors.push(config_error(
                    key,
                    value,
                    "each key once (the last value given applies)",
                ));
            } else {
                seen.push(key);
            }
            match parse_setting(key, value) {
                Ok(setting) => {
                    parsed.accepted.push(setting);
                    if let Some(disables) = disables(setting) {
                        parsed.add(Error::SettingDisables {
                            key: key.to_owned(),
                            value: value.to_owned(),
                            disables,
                        });
                    }
                }
                Err(e) => parsed.add(e),
            }
        }
        // pin=strict with no room to pin says so itself, once (see `Unpinnable`).
        if parsed.sets(|s| *s == Setting::Pin(PinMode::Strict)) {
            parsed
                .errors
                .retain(|e| !matches!(e, Error::SettingDisables { key, .. } if key == "pin_limit"));
        }
        if seen.contains(&"node") && seen.contains(&"gpu") {
            parsed.errors.push(config_error(
                "node",
                "",
                "either node= or gpu=, not both (the later one applies)",
            ));
        }
        parsed
    }

    /// Records `error` unless the same one was recorded already (an entry given again).
    fn add(&mut self, error: Error) {
        if !self.errors.contains(&error) {
            self.errors.push(error);
        }
    }

    /// Applies the accepted entries to `config`, in order.
    pub(crate) fn apply_to(&self, config: &mut Config) {
        for &setting in &self.accepted {
            config.set(setting);
        }
    }

    /// Whether an accepted entry is one of those `which` picks.
    pub(crate) fn sets(&self, which: fn(&Setting) -> bool) -> bool {
        self.accepted.iter().any(which)
    }
}

/// Parses one entry (see [`Config::apply`]).
pub(super) fn parse_setting(key: &str, value: &str) -> Result<Setting, Error> {
    Ok(match key {
        "threshold" => Setting::Threshold(parse_threshold(value)?),
        "node" if value == "local" => Setting::Target(Target::LocalNode),
        "node" => Setting::Target(Target::Node(parse_node(value)?)),
        "gpu" => Setting::Target(Target::Gpu(parse_gpu(value)?)),
        "policy" => Setting::Policy(parse_policy(value)?),
        "cache" => Setting::CacheLimit(
            parse_size(value).ok_or_else(|| config_error(key, value, SIZE_FORMAT))?,
        ),
        "huge" => Setting::HugePages(parse_switch(key, value)?),
        "verify" => Setting::Verify(parse_switch(key, value)?),
        "pin" => Setting::Pin(parse_pin(value)?),
        "devicemap" => Setting::PinDevicemap(parse_switch(key, value)?),
        "readonly" => Setting::PinReadOnly(parse_switch(key, value)?),
        "pin_limit" if value == "none" => Setting::PinLimit(usize::MAX),
        "pin_limit" => Setting::PinLimit(
            parse_size(value).ok_or_else(|| config_error(key, value, PIN_LIMIT_FORMAT))?,
        ),
        "threads" => Setting::PopulateThreads(parse_threads(value)?),
        "populate" => Setting::PopulateEager(parse_populate(value)?),
        "bulk_max" => Setting::BulkMax(
            parse_size(value).ok_or_else(|| config_error(key, value, SIZE_FORMAT))?,
        ),
        "stats" => Setting::StatsAtExit(parse_stats(value)?),
        "reserve" => Setting::Reserve(parse_reserve(value)?),
        "reserve_background" => Setting::ReserveBackground(parse_switch(key, value)?),
        "register_max" => Setting::RegisterMax(parse_register_max(value)?),
        "decay" => Setting::DecayMs(parse_decay(value)?),
        "decay_thread" => Setting::DecayThread(parse_switch(key, value)?),
        _ => {
            return Err(config_error(
                key,
                value,
                "one of threshold, node, gpu, policy, cache, huge, verify, pin, devicemap, \
                 readonly, pin_limit, register_max, threads, populate, bulk_max, stats, reserve, \
                 reserve_background, decay, decay_thread",
            ))
        }
    })
}

/// What an accepted setting switches off, said at set-up in case it was not meant.
fn disables(setting: Setting) -> Option<&'static str> {
    Some(match setting {
        Setting::CacheLimit(0) => {
            "nothing freed is kept for reuse: each large free gives its memory back at once, and \
             each large allocation maps, places and populates anew (cache=SIZE keeps up to SIZE)"
        }
        Setting::DecayMs(0) => {
            "idle memory is given back at once: free space is purged as soon as it is freed, so \
             reusing it pays the page faults and zeroing again (decay=off never gives it back)"
        }
        Setting::PinLimit(0) => {
            "no byte may be page-locked: pin=on serves every block unpinned, pin=strict fails \
             every large request (pin_limit=none: no limit)"
        }
        _ => return None,
    })
}

const SIZE_FORMAT: &str = "a size such as 4096, 512KiB, 4MiB or 8GiB";
const PIN_LIMIT_FORMAT: &str = "a size such as 512MiB or 64GiB, or none";

pub(crate) fn config_error(key: &str, value: &str, expected: &'static str) -> Error {
    Error::Config {
        key: key.to_owned(),
        value: value.to_owned(),
        expected,
    }
}

/// Parses `4096`, `512KiB`, `4MiB`, `8GiB`, `1TiB` (also `K`/`KB`/`M`/`MB`/... as binary units,
/// case-insensitive; spaces around the unit are fine). `None` on garbage, control characters or
/// overflow.
pub fn parse_size(value: &str) -> Option<usize> {
    // Trimming below would otherwise skip a newline or tab between number and unit.
    if value.contains(char::is_control) {
        return None;
    }
    let value = value.trim();
    let split = value
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(value.len());
    let (digits, unit) = value.split_at(split);
    let number: usize = digits.parse().ok()?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => return None,
    };
    number.checked_mul(1usize.checked_shl(shift)?)
}

/// Parses a `threshold=` value and checks its range.
pub fn parse_threshold(value: &str) -> Result<usize, Error> {
    match parse_size(value) {
        Some(t) if (MIN_THRESHOLD..=MAX_THRESHOLD).contains(&t) => Ok(t),
        _ => Err(config_error(
            "threshold",
            value,
            "a size from 4KiB to 64GiB, such as 2MiB",
        )),
    }
}

fn parse_node(value: &str) -> Result<usize, Error> {
    match value.parse::<usize>() {
        Ok(n) if n < MAX_NODES => Ok(n),
        _ => Err(config_error(
            "node",
            value,
            "a NUMA node id from 0 to 1023 (an online node of this machine), or local",
        )),
    }
}

/// Parses a `gpu=` selector: `auto`, `current`, an ordinal (`0`), `pci:0000:81:00.0`, or a UUID
/// as `nvidia-smi -L` prints it (`GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, or `MIG-…` for a MIG
/// instance).
pub fn parse_gpu(value: &str) -> Result<GpuSelector, Error> {
    const EXPECTED: &str = "auto, current, a device ordinal (0), pci:DOMAIN:BUS:DEV.FN \
                            (pci:0000:81:00.0) or a UUID (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)";
    let bad = || config_error("gpu", value, EXPECTED);
    if value.eq_ignore_ascii_case("auto") {
        Ok(GpuSelector::Auto)
    } else if value.eq_ignore_ascii_case("current") {
        Ok(GpuSelector::Current)
    } else if let Some(addr) = value.strip_prefix("pci:") {
        addr.parse().map(GpuSelector::Pci).map_err(|_| bad())
    } else if let Some(uuid) =
        strip_prefix_ignore_case(value, "GPU-").or_else(|| strip_prefix_ignore_case(value, "MIG-"))
    {
        parse_uuid(uuid).map(GpuSelector::Uuid).ok_or_else(bad)
    } else {
        value.parse().map(GpuSelector::Ordinal).map_err(|_| bad())
    }
}

fn strip_prefix_ignore_case<'a>(text: &'a str, prefix: &str) -> Option<&'a str> {
    let head = text.get(..prefix.len())?;
    head.eq_ignore_ascii_case(prefix)
        .then(|| &text[prefix.len()..])
}

/// Parses the 32 hex digits of a UUID, with or without dashes in the usual places.
fn parse_uuid(text: &str) -> Option<[u8; 16]> {
    let mut bytes = [0u8; 16];
    let mut digits = text.chars().filter(|&c| c != '-');
    for byte in &mut bytes {
        let hi = digits.next()?.to_digit(16)?;
        let lo = digits.next()?.to_digit(16)?;
        *byte = u8::try_from(hi * 16 + lo).ok()?;
    }
    let dashes_ok = text.len() == 32 || text.len() == 36;
    (digits.next().is_none() && dashes_ok).then_some(bytes)
}

fn parse_policy(value: &str) -> Result<MemPolicy, Error> {
    match value.to_ascii_lowercase().as_str() {
        "preferred" => Ok(MemPolicy::Preferred),
        "bind" => Ok(MemPolicy::Bind),
        "interleave" => Ok(MemPolicy::Interleave),
        _ => Err(config_error(
            "policy",
            value,
            "preferred, bind or interleave",
        )),
    }
}

fn parse_pin(value: &str) -> Result<PinMode, Error> {
    match value.to_ascii_lowercase().as_str() {
        // `fallback` was this mode's name before pinning became opt-in.
        "on" | "fallback" => Ok(PinMode::On),
        "strict" => Ok(PinMode::Strict),
        "off" => Ok(PinMode::Off),
        _ => Err(config_error("pin", value, "on, strict or off")),
    }
}

fn parse_switch(key: &str, value: &str) -> Result<bool, Error> {
    match value.to_ascii_lowercase().as_str() {
        "on" | "true" | "1" | "yes" => Ok(true),
        "off" | "false" | "0" | "no" => Ok(false),
        _ => Err(config_error(key, value, "on or off")),
    }
}

fn parse_populate(value: &str) -> Result<bool, Error> {
    match value.to_ascii_lowercase().as_str() {
        "lazy" => Ok(false),
        "eager" => Ok(true),
        _ => Err(config_error("populate", value, "lazy or eager")),
    }
}

fn parse_stats(value: &str) -> Result<StatsAtExit, Error> {
    match value.to_ascii_lowercase().as_str() {
        "off" => Ok(StatsAtExit::Off),
        "exit" => Ok(StatsAtExit::Table),
        "json" => Ok(StatsAtExit::Json),
        _ => Err(config_error(
            "stats",
            value,
            "exit (the table at exit), json (JSON at exit) or off",
        )),
    }
}

/// Parses a `reserve=` value: `COUNTxSIZE` (`8x64MiB`: room for blocks of that size), `SIZE`
/// (`3GiB`: bytes of room) or `0` (none).
pub(super) fn parse_reserve(value: &str) -> Result<Reserve, Error> {
    let reserve = match value.split_once(['x', 'X']) {
        Some((count, size)) => count
            .trim()
            .parse()
            .ok()
            .zip(parse_size(size))
            .map(|(blocks, size)| Reserve::blocks(blocks, size)),
        None => parse_size(value).map(Reserve::bytes),
    };
    match reserve {
        Some(reserve) if reserve.is_none() => Ok(Reserve::NONE),
        Some(reserve) => Ok(reserve),
        None => Err(config_error(
            "reserve",
            value,
            "COUNTxSIZE such as 24x128MiB (room for blocks of a size), a size such as 3GiB \
             (bytes of room) or 0",
        )),
    }
}

/// Parses a `register_max=` value: a size from 2 MiB to 1 GiB, rounded up to 2 MiB.
fn parse_register_max(value: &str) -> Result<usize, Error> {
    parse_size(value)
        .filter(|bytes| (MIN_REGISTER_MAX..=MAX_REGISTER_MAX).contains(bytes))
        .map(|bytes| bytes.next_multiple_of(MIN_REGISTER_MAX))
        .ok_or_else(|| {
            config_error(
                "register_max",
                value,
                "a size from 2MiB to 1GiB such as 256MiB (the most one chunk's registration covers)",
            )
        })
}

/// Parses a `decay=` value: milliseconds (`500`, `500ms`), seconds (`2s`), or `off` (never).
fn parse_decay(value: &str) -> Result<u64, Error> {
    let lower = value.to_ascii_lowercase();
    let (digits, scale) = if lower == "off" || lower == "never" {
        return Ok(u64::MAX);
    } else if let Some(ms) = lower.strip_suffix("ms") {
        (ms, 1)
    } else if let Some(s) = lower.strip_suffix('s') {
        (s, 1000)
    } else {
        (lower.as_str(), 1)
    };
    digits
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(scale))
        .ok_or_else(|| {
            config_error(
                "decay",
                value,
                "milliseconds (500, 500ms), seconds (2s) or off",
            )
        })
}

fn parse_threads(value: &str) -> Result<usize, Error> {
    if value.eq_ignore_ascii_case("auto") {
        return Ok(0);
    }
    match value.parse::<usize>() {
        Ok(n) if (1..=1024).contains(&n) => Ok(n),
        _ => Err(config_error(
            "threads",
            value,
            "auto or a thread count from 1 to 1024",
        )),
    }
}

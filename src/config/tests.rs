//! Unit tests of the settings and their parsing.

use super::parse::{parse_gpu, parse_reserve};
use super::*;

fn key_of(e: &Error) -> &str {
    match e {
        Error::Config { key, .. } => key,
        other => panic!("not a config error: {other:?}"),
    }
}

#[test]
fn sizes() {
    assert_eq!(parse_size("4096"), Some(4096));
    assert_eq!(parse_size("4MiB"), Some(4 << 20));
    assert_eq!(parse_size("8gib"), Some(8 << 30));
    assert_eq!(parse_size("512K"), Some(512 << 10));
    assert_eq!(parse_size("1TiB"), Some(1 << 40));
    assert_eq!(parse_size(""), None);
    assert_eq!(parse_size("MiB"), None);
    assert_eq!(parse_size("4 PiB"), None);
    assert_eq!(parse_size(" 4 MiB "), Some(4 << 20));
    for control in ["4\nMiB", "4\tMiB", "4MiB\n", "\u{1b}4MiB"] {
        assert_eq!(parse_size(control), None, "{control:?}");
    }
    assert_eq!(parse_size("99999999999999999999"), None);
    assert_eq!(parse_size("18446744073709551615GiB"), None);
}

#[test]
fn targets_that_follow_the_thread() {
    let mut c = Config::DEFAULT;
    assert!(c.apply_settings("node=local").is_empty());
    assert_eq!(c.target, Target::LocalNode);
    assert!(c.apply_settings("gpu=current").is_empty());
    assert_eq!(c.target, Target::Gpu(GpuSelector::Current));
}

#[test]
fn full_example_applies() {
    let mut c = Config::DEFAULT;
    let errors =
        c.apply_settings("threshold=4MiB,node=1,policy=bind,cache=8GiB,huge=off,verify=on");
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(c.threshold, 4 << 20);
    assert_eq!(c.target, Target::Node(1));
    assert_eq!(c.policy, MemPolicy::Bind);
    assert_eq!(c.cache_limit, 8 << 30);
    assert!(!c.huge_pages);
    assert!(c.verify);
}

#[test]
fn bad_entries_are_reported_and_the_rest_applies() {
    let mut c = Config::DEFAULT;
    let errors = c.apply_settings("threshold=0,cache=1GiB,bogus=1,node=99999,policy=strict");
    let keys: Vec<&str> = errors.iter().map(key_of).collect();
    assert_eq!(keys, ["threshold", "bogus", "node", "policy"]);
    assert_eq!(c.threshold, DEFAULT_THRESHOLD);
    assert_eq!(c.cache_limit, 1 << 30);
    assert_eq!(c.target, Target::Default);
    let text = errors[0].to_string();
    assert!(text.contains("threshold") && text.contains("\"0\"") && text.contains("4KiB"));
}

#[test]
fn out_of_range_duplicates_and_conflicts() {
    let mut c = Config::DEFAULT;
    assert_eq!(c.apply_settings("threshold=1TiB").len(), 1);
    let errors = c.apply_settings("huge=off,huge=on");
    assert_eq!(errors.len(), 1);
    assert!(c.huge_pages, "the last value applies");
    let errors = c.apply_settings("node=1,gpu=pci:0000:81:00.0");
    assert_eq!(errors.len(), 1);
    assert!(matches!(c.target, Target::Gpu(GpuSelector::Pci(_))));
    assert!(c.apply_settings("").is_empty());
    assert!(c.apply_settings(",,, ,").is_empty());
    assert_eq!(c.apply_settings("novalue").len(), 1);
}

#[test]
fn stats_at_exit() {
    let mut c = Config::DEFAULT;
    assert_eq!(c.stats_at_exit, StatsAtExit::Off);
    assert!(c.apply_settings("stats=exit").is_empty());
    assert_eq!(c.stats_at_exit, StatsAtExit::Table);
    assert!(c.apply_settings("stats=JSON").is_empty());
    assert_eq!(c.stats_at_exit, StatsAtExit::Json);
    let errors = c.apply_settings("stats=on");
    assert_eq!(errors.iter().map(key_of).collect::<Vec<_>>(), ["stats"]);
    assert_eq!(
        c.stats_at_exit,
        StatsAtExit::Json,
        "a rejected value changes nothing"
    );
}

#[test]
fn reserve_values() {
    let reserve = parse_reserve;
    assert_eq!(reserve("8x64MiB"), Ok(Reserve::blocks(8, 64 << 20)));
    assert_eq!(reserve(" 2 X 1GiB"), Ok(Reserve::blocks(2, 1 << 30)));
    assert_eq!(reserve("256MiB"), Ok(Reserve::bytes(256 << 20)));
    assert_eq!(reserve("0"), Ok(Reserve::NONE));
    assert_eq!(reserve("0x4MiB"), Ok(Reserve::NONE));
    for bad in ["", "x4MiB", "4x", "-1x4MiB", "4MiBx2", "lots"] {
        assert!(parse_reserve(bad).is_err(), "{bad}");
    }
    let mut c = Config::DEFAULT;
    assert!(c.apply_settings("reserve=4x8MiB").is_empty());
    assert_eq!(c.reserve, Reserve::blocks(4, 8 << 20));
    assert!(c.apply_settings("reserve=3GiB").is_empty());
    assert_eq!(c.reserve, Reserve::bytes(3 << 30));
    assert!(c.apply_settings("register_max=100MiB").is_empty());
    assert_eq!(c.register_max, 100 << 20);
    assert!(c.apply_settings("register_max=3MiB").is_empty());
    assert_eq!(c.register_max, 4 << 20, "rounded up to 2 MiB");
    for bad in ["1MiB", "2GiB", "lots"] {
        assert_eq!(
            c.apply_settings(&format!("register_max={bad}")).len(),
            1,
            "{bad}"
        );
    }
}

#[test]
fn gpu_selectors() {
    assert_eq!(parse_gpu("auto"), Ok(GpuSelector::Auto));
    assert_eq!(parse_gpu("current"), Ok(GpuSelector::Current));
    assert_eq!(parse_gpu("3"), Ok(GpuSelector::Ordinal(3)));
    let uuid = parse_gpu("GPU-00112233-4455-6677-8899-aabbccddeeff").unwrap();
    assert_eq!(
        uuid,
        GpuSelector::Uuid([
            0x00, 0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88, 0x99, 0xaa, 0xbb, 0xcc, 0xdd,
            0xee, 0xff
        ])
    );
    assert_eq!(
        parse_gpu("MIG-00112233-4455-6677-8899-aabbccddeeff"),
        Ok(uuid),
        "a MIG instance's UUID"
    );
    assert!(parse_gpu("GPU-0011").is_err());
    assert!(parse_gpu("pci:zz").is_err());
    assert!(parse_gpu("-1").is_err());
    assert!(parse_gpu("GPU-ééé").is_err());
    assert!(parse_gpu("aéé").is_err());
}

#[test]
fn each_problem_is_reported_once() {
    let mut c = Config::DEFAULT;
    let errors = c.apply_settings(&["cache=1GiB"; 500].join(","));
    assert_eq!(
        errors,
        [config_error(
            "cache",
            "1GiB",
            "each key once (the last value given applies)"
        )]
    );
    // The value that applies is named.
    let errors = c.apply_settings("cache=1GiB,cache=2GiB,cache=3GiB");
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(
        errors[0].to_string().contains("cache=\"3GiB\""),
        "{errors:?}"
    );
    assert_eq!(c.cache_limit, 3 << 30);
    // An unknown key given 500 times: that, and its repetition.
    let errors = c.apply_settings(&["colour=blue"; 500].join(","));
    assert_eq!(errors.iter().map(key_of).collect::<Vec<_>>(), ["colour"; 2]);
}

#[test]
fn values_that_switch_something_off_are_said() {
    for (text, key) in [
        ("cache=0", "cache"),
        ("decay=0", "decay"),
        ("decay=0ms", "decay"),
        ("pin_limit=0", "pin_limit"),
        ("pin=on,pin_limit=0B", "pin_limit"),
    ] {
        let mut c = Config::DEFAULT;
        let errors = c.apply_settings(text);
        assert!(
            matches!(&errors[..], [Error::SettingDisables { key: k, .. }] if k == key),
            "{text}: {errors:?}"
        );
        assert!(errors[0].to_string().contains("accepted"), "{}", errors[0]);
    }
    let mut c = Config::DEFAULT;
    assert_eq!(c.apply_settings("cache=0,decay=0").len(), 2);
    assert_eq!((c.cache_limit, c.decay_ms), (0, 0), "applied all the same");
    // Under pin=strict the refusal at set-up says it, once.
    assert!(c.apply_settings("pin=strict,pin_limit=0").is_empty());
    assert!(c
        .apply_settings("cache=1MiB,decay=1,pin_limit=1MiB")
        .is_empty());
}

#[test]
fn bulk_max_values() {
    let mut c = Config::DEFAULT;
    assert_eq!(c.bulk_max, DEFAULT_BULK_MAX);
    assert_eq!(DEFAULT_BULK_MAX, 256 << 20);
    assert!(
        c.apply_settings("bulk_max=0").is_empty(),
        "0 is no switch-off"
    );
    assert_eq!(c.bulk_max, 0);
    assert!(c.apply_settings("bulk_max=1GiB").is_empty());
    assert_eq!(c.bulk_max, 1 << 30);
    for bad in ["", "all", "-1", "1PiB"] {
        let errors = c.apply_settings(&format!("bulk_max={bad}"));
        assert_eq!(errors.iter().map(key_of).collect::<Vec<_>>(), ["bulk_max"]);
        assert!(errors[0].to_string().contains("512KiB"), "{}", errors[0]);
    }
    assert_eq!(c.bulk_max, 1 << 30, "a rejected value changes nothing");
}

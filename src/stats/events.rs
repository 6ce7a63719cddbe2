//! The one declaration of each event counter: [`snapshot!`](snapshot) turns a field listed in a
//! snapshot struct's `events { … }` block into everything a counter needs, so that adding one is
//! one entry (its doc and name, and its table label) in `stats.rs`, plus the call that counts it.

/// Declares snapshot structs whose `events { … }` block lists event counters. From each entry
/// (doc comments, name, optional `: "table label"`) it makes:
///
/// - the public `u64` field with that doc, at that place in the struct (so in `Debug`, JSON and
///   `serde` order);
/// - the relaxed atomic of the same name in `Events` (call sites write `counters.name.incr()`);
/// - its copy into the snapshot (`copy_events`);
/// - its JSON key (through `json_object!`);
/// - with a label, its place in the table: after the hand-phrased part of its struct's line, as
///   `, label value`, in declaration order (`labelled_events`). Entries without one are phrased
///   by hand in `table.rs` (lines that read as sentences); a unit test checks every counter is
///   printed.
///
/// Fields before and after the block are written as usual, and filled and printed by hand.
macro_rules! snapshot {
    ($(
        $(#[$attr:meta])*
        pub struct $name:ident {
            $($(#[$before_attr:meta])* pub $before:ident: $before_ty:ty,)*
            events {
                $($(#[doc = $doc:literal])* $event:ident $(: $label:literal)?,)*
            }
            $($(#[$after_attr:meta])* pub $after:ident: $after_ty:ty,)*
        }
    )*) => {
        $(
            $(#[$attr])*
            pub struct $name {
                $($(#[$before_attr])* pub $before: $before_ty,)*
                $($(#[doc = $doc])* pub $event: u64,)*
                $($(#[$after_attr])* pub $after: $after_ty,)*
            }

            impl $name {
                /// Copies this struct's event counters from `events`.
                fn copy_events(&mut self, events: &Events) {
                    $(self.$event = events.$event.get();)*
                }

                /// The labelled event counters, label and value, in declaration order (the table
                /// ends this struct's line with them).
                fn labelled_events(&self) -> impl Iterator<Item = (&'static str, u64)> {
                    [$($(($label, self.$event),)?)*].into_iter()
                }
            }

            $crate::stats::json::json_object! {
                $name { $($before,)* $($event,)* $($after,)* }
            }
        )*

        /// The relaxed atomic behind each event field of the snapshot structs.
        #[derive(Default)]
        pub(crate) struct Events {
            $($($(#[doc = $doc])* pub(crate) $event: $crate::stats::counters::Counter,)*)*
        }

        #[cfg(test)]
        impl Events {
            /// Every counter, in declaration order.
            fn each(&self) -> impl Iterator<Item = &$crate::stats::counters::Counter> {
                [$($(&self.$event,)*)*].into_iter()
            }
        }
    };
}
pub(super) use snapshot;

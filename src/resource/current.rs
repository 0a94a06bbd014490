//! The per-device default resource: what buffers made without a resource allocate from. RMM's
//! `get_current_device_resource` / `set_current_device_resource` (its per-device form,
//! `get_per_device_resource(id)`).
//!
//! One process-wide map, device → [`ResourceRef`], keyed by [`Device::id`]. The id belongs to a
//! device *handle* (and its clones): opening the same GPU twice gives two handles with two
//! defaults. The first [`current_resource`] of a device that has none makes a
//! [`CudaResource`] of it (on the simulated device, its equivalent: simulated device memory)
//! and keeps it.
//!
//! The map holds a strong reference to each resource, and so to its device: a device with an
//! entry is not dropped until [`reset_current_resource`] removes it. Every function here is
//! thread-safe with respect to the others; a reader never waits for an allocation, only for a
//! concurrent update of the map.
//!
//! ```
//! use std::sync::Arc;
//! use streamalloc::resource::current::{current_resource, set_current_resource};
//! use streamalloc::resource::pool::{PoolOptions, PoolResource};
//! use streamalloc::resource::cuda::CudaResource;
//! use streamalloc::{Device, SimConfig};
//!
//! let device = Device::simulated(SimConfig::default());
//! let pool = PoolResource::new(CudaResource::new(&device), PoolOptions::default())?;
//! let previous = set_current_resource(&device, Arc::new(pool));
//! assert!(previous.is_none()); // nothing was set or made for this device before
//! let mr = current_resource(&device); // the pool
//! # streamalloc::resource::current::reset_current_resource(&device);
//! # Ok::<(), streamalloc::Error>(())
//! ```
//!
//! Like RMM, set the default before making allocations that use it: memory must go back to the
//! resource it came from, so a buffer keeps its own handle to the resource it was made from,
//! and changing the default later only affects buffers made afterwards.

use std::collections::BTreeMap;
use std::sync::Arc as StdArc;

use super::cuda::CudaResource;
use super::ResourceRef;
use crate::device::Device;
use crate::sync::plain::RwLock;

/// Device id → its current resource. std's lock (not loom's): a process-wide static cannot be a
/// loom object, and nothing here is a protocol worth modelling.
static CURRENT: RwLock<BTreeMap<u64, ResourceRef>> = RwLock::new(BTreeMap::new());

/// The current resource of `device`: the last one [set](set_current_resource), else a
/// [`CudaResource`] of the device, made on first use and kept.
pub fn current_resource(device: &Device) -> ResourceRef {
    if let Some(r) = CURRENT
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .get(&device.id())
    {
        return r.clone();
    }
    CURRENT
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .entry(device.id())
        .or_insert_with(|| StdArc::new(CudaResource::new(device)))
        .clone()
}

/// Makes `resource` the current resource of `device`. Returns the previous one, or `None` if
/// the device had none yet (neither set nor made by [`current_resource`]).
///
/// `resource` should belong to `device`: one of another device is stored as given, and
/// allocations through it on `device`'s streams fail with
/// [`Error::WrongDevice`](crate::Error::WrongDevice) (a warning is logged here).
pub fn set_current_resource(device: &Device, resource: ResourceRef) -> Option<ResourceRef> {
    if resource.device().id() != device.id() {
        tracing::warn!(
            device = device.id(),
            resource_device = resource.device().id(),
            "set_current_resource: the resource belongs to another device"
        );
    }
    CURRENT
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .insert(device.id(), resource)
}

/// Forgets the current resource of `device` (the next [`current_resource`] makes a new
/// default) and returns it. Use it to let a device and its resource be dropped: the map keeps
/// both alive otherwise. RMM's `set_current_device_resource(nullptr)`.
pub fn reset_current_resource(device: &Device) -> Option<ResourceRef> {
    CURRENT
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&device.id())
}

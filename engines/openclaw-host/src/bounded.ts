// The one way the host bounds what peers can grow: a map of at most `max`
// entries, the least recently set (or used) forgotten first.

export class BoundedMap<K, V> extends Map<K, V> {
  constructor(private readonly max: number) {
    super();
  }

  /** Sets `key` as the most recent entry, forgetting the oldest past `max`. */
  override set(key: K, value: V): this {
    super.delete(key);
    super.set(key, value);
    if (this.size > this.max) super.delete(this.keys().next().value!);
    return this;
  }

  /** The value of `key`, marked most recently used. */
  use(key: K): V | undefined {
    const value = super.get(key);
    if (value !== undefined) this.set(key, value);
    return value;
  }
}

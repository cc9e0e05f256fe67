package shopperintents;

import org.apache.flink.metrics.Gauge;

/**
 * A gauge holding a number that the Python operator sets, so that Flink reads it without
 * calling into Python.
 *
 * <p>A gauge registered through PyFlink's API in thread mode wraps a Python callable, which
 * the JVM then calls from its own threads (a metrics reporter's, the JobManager's metric
 * fetcher). One such call while a finishing task's embedded interpreter was being closed
 * crashed the TaskManager's JVM. The operator's own thread publishes its figures here
 * instead ({@code flink_jobs.metrics.GaugeBoard}), and a reader only reads this field.
 */
public final class PublishedGauge implements Gauge<Long> {
    private volatile long value;

    public void set(long value) {
        this.value = value;
    }

    @Override
    public Long getValue() {
        return value;
    }
}

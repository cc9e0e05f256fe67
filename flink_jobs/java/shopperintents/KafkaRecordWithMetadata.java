package shopperintents;

import java.io.IOException;
import org.apache.flink.api.common.typeinfo.PrimitiveArrayTypeInfo;
import org.apache.flink.api.common.typeinfo.TypeInformation;
import org.apache.flink.api.common.typeinfo.Types;
import org.apache.flink.connector.kafka.source.reader.deserializer.KafkaRecordDeserializationSchema;
import org.apache.flink.types.Row;
import org.apache.flink.util.Collector;
import org.apache.kafka.clients.consumer.ConsumerRecord;

/**
 * Hands each Kafka record to Python untouched, with where it came from.
 *
 * <p>PyFlink's built-in value deserializers decode the payload in the JVM (a bad byte
 * sequence is silently replaced) and drop topic, partition and offset. The dead-letter
 * records must carry the exact bytes and their source position, so the payload stays
 * raw and the position rides along: Row(topic, partition, offset, timestamp, value).
 */
public final class KafkaRecordWithMetadata implements KafkaRecordDeserializationSchema<Row> {
    private static final long serialVersionUID = 1L;

    public static final String[] FIELD_NAMES = {"topic", "partition", "offset", "timestamp", "value"};

    @Override
    public void deserialize(ConsumerRecord<byte[], byte[]> record, Collector<Row> out)
            throws IOException {
        byte[] value = record.value();
        out.collect(
                Row.of(
                        record.topic(),
                        record.partition(),
                        record.offset(),
                        record.timestamp(),
                        value == null ? new byte[0] : value));
    }

    @Override
    public TypeInformation<Row> getProducedType() {
        return Types.ROW_NAMED(
                FIELD_NAMES,
                Types.STRING,
                Types.INT,
                Types.LONG,
                Types.LONG,
                PrimitiveArrayTypeInfo.BYTE_PRIMITIVE_ARRAY_TYPE_INFO);
    }
}
